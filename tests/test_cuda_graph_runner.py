"""CPU-checkable parts of the GPU runner path: the graph ladder, persistent buffers and padding rows."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.worker.cuda_graphs import StepBuffers, graph_ladder, padded_size
from pagedllm.worker.input_prep import plan_inputs, prepare_inputs

CPU = torch.device("cpu")


def test_ladder_and_padding_size() -> None:
    assert graph_ladder(64)[:5] == [1, 2, 4, 8, 16] and graph_ladder(64)[-1] == 64
    assert graph_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert graph_ladder(256)[-4:] == [160, 192, 224, 256] and len(graph_ladder(256)) == 17
    assert graph_ladder(1) == [1]
    sizes = graph_ladder(64)
    assert padded_size(sizes, 3) == 4 and padded_size(sizes, 8) == 8 and padded_size(sizes, 9) == 16
    assert padded_size(sizes, 65) is None


def _step() -> tuple[list[list[int]], list[int], list[int], list[list[int]]]:
    # two decodes, then a prefill chunk; block_size 4
    return [list(range(10)), list(range(5)), list(range(9))], [9, 4, 2], [1, 1, 5], [[3, 4, 5], [6, 7], [8, 9, 2]]


def test_buffers_match_fresh_tensors() -> None:
    tokens, computed, sched, blocks = _step()
    fresh = prepare_inputs(tokens, computed, sched, blocks, 4, CPU, 2)
    buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=8, device=CPU)
    # a bigger earlier step leaves stale contents behind: the views must not show them
    buffers.load(plan_inputs([list(range(30))] * 4, [0] * 4, [4] * 4, [list(range(1, 9))] * 4, 4, 0))
    got = buffers.load(plan_inputs(tokens, computed, sched, blocks, 4, 2))
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(fresh, name)), name
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(got.attn, name), getattr(fresh.attn, name)), name
    width = fresh.attn.block_table.shape[1]
    assert torch.equal(got.attn.block_table[:, :width], fresh.attn.block_table)
    assert (got.attn.num_reqs, got.attn.num_actual_tokens, got.attn.num_decodes) == (3, 7, 2)
    assert not buffers.fits(plan_inputs([list(range(40))], [0], [17], [list(range(1, 11))], 4, 0))


def test_padding_rows_are_harmless_decodes() -> None:
    tokens, computed, sched, blocks = [list(range(10)), list(range(5))], [9, 4], [1, 1], [[3, 4, 5], [6, 7]]
    buffers = StepBuffers(max_tokens=8, max_reqs=4, max_blocks=4, device=CPU)
    host = plan_inputs(tokens, computed, sched, blocks, 4, 2)
    padded = buffers.load(host, pad_to=4)
    attn = padded.attn
    assert attn.num_reqs == attn.num_decodes == attn.num_actual_tokens == 4
    assert attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert attn.seq_lens.tolist()[2:] == [1, 1]
    assert attn.slot_mapping.tolist()[2:] == [0, 0]  # the null block's slot 0
    assert attn.block_table[2:, 0].tolist() == [0, 0]

    _assert_padding_harmless(attn, prepare_inputs(tokens, computed, sched, blocks, 4, CPU, 2).attn)


def _assert_padding_harmless(padded: Any, plain: Any) -> None:
    """The real rows' attention output (torch backend) is the same with and without the padding requests,
    and the padding rows are finite."""
    layer = AttentionLayerConfig(4, 8, 2, 8**-0.5)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 10, 4, 2, 8, generator=gen)
    t, n = padded.num_actual_tokens, plain.num_actual_tokens
    q, k, v = (torch.randn(t, h, 8, generator=gen) for h in (4, 2, 2))
    impl = TorchSDPABackend.make_impl(layer)
    out_pad = impl.forward(q, k, v, cache.clone(), TorchSDPABackend.build_metadata(padded))
    out = impl.forward(q[:n], k[:n], v[:n], cache.clone(), TorchSDPABackend.build_metadata(plain))
    assert torch.allclose(out_pad[:n], out, atol=1e-6)
    assert torch.isfinite(out_pad).all()


def test_uniform_multi_token_padding() -> None:
    """Speculative verification steps (q = k + 1 tokens per request) padded to a graph's size: each padding
    request is q tokens at positions 0..q-1 in slots 0..q-1 of the null block, and the real rows' attention
    is unchanged (cuda_graphs.py NOTE 3)."""
    q = 3
    tokens, computed, sched, blocks = [list(range(12)), list(range(7))], [9, 4], [q, q], [[3, 4, 5], [6, 7]]
    buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=4, device=CPU)
    host = plan_inputs(tokens, computed, sched, blocks, 4, 0)
    assert host.num_tokens == host.num_reqs * host.max_query_len  # what DecodeGraphs.run calls uniform
    assert buffers.fits(host, 4, q) and not buffers.fits(host, 8, q)
    padded = buffers.load(host, pad_to=4, query_len=q)
    attn = padded.attn
    assert (attn.num_reqs, attn.num_actual_tokens, attn.num_decodes) == (4, 12, 0)
    assert attn.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert attn.seq_lens.tolist() == [12, 7, 3, 3]
    assert attn.slot_mapping.tolist()[6:] == [0, 1, 2, 0, 1, 2]
    assert padded.positions.tolist() == [9, 10, 11, 4, 5, 6, 0, 1, 2, 0, 1, 2]
    assert padded.logits_indices.tolist() == [2, 5, 8, 11]
    assert attn.block_table[2:, 0].tolist() == [0, 0]

    _assert_padding_harmless(attn, prepare_inputs(tokens, computed, sched, blocks, 4, CPU, 0).attn)


def test_profile_batch_stays_within_positions_and_disjoint_blocks() -> None:
    """The memory-profiling step of a 16,384-token budget on an 8,192-position model (the H200 default) is cut
    into sequences that never index positions past the model's end, over blocks no two sequences share."""
    from pagedllm.worker.memory_profile import profile_batch

    for num_tokens, max_len, sizes in ((16384, 8192, [16]), (100, 30, [4, 8]), (7, None, [16])):
        lens, tables = profile_batch(num_tokens, max_len, sizes)
        assert sum(lens) == num_tokens and max(lens) <= (max_len or num_tokens)
        more = list(zip(tables[1:], sizes[1:], strict=True))
        inputs = prepare_inputs([[0] * n for n in lens], [0] * len(lens), lens, tables[0], sizes[0],
                                CPU, 0, more)
        assert int(inputs.positions.max()) < (max_len or num_tokens)
        for table in tables:
            flat = [b for row in table for b in row]
            assert len(flat) == len(set(flat)) and min(flat) >= 1  # block 0 is the null block
        slots = inputs.attn.slot_mapping.tolist()
        assert len(slots) == len(set(slots)) == num_tokens
