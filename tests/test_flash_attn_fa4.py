"""The flash_attn backend's FlashAttention-4 path, checked on the CPU (flash-attn-4 needs a GPU).

Two things are checked here; the kernel itself is checked on the H200 (examples/gpu/attn_backends_check.py).
1. The plugin refuses what flash-attn-4 4.0.0b36 refuses (its `_validate_head_dims`), with a reason.
2. The arguments the backend passes mean what FA4 reads them as: `fa4_contract` below holds the argument
   checks copied from 4.0.0b36's `_flash_attn_fwd` (flash_attn/cute/interface.py) and computes what FA4
   documents for paged varlen attention -- request b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1],
   its keys the first seqused_k[b] slots of the pages page_table[b], causal aligned bottom-right, a key at
   most window_size_left positions left of the query, scores soft-capped -- into `out`. Its result must equal
   the torch reference backend's on the same cache: a wrong tensor (context before the step instead of after,
   the padded block table, a window off by one) makes them differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedllm.plugins.attention import flash_attn
from pagedllm.plugins.attention.flash_attn.backend import FlashAttnImpl, FlashAttnMetadata
from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.worker.input_prep import prepare_inputs

FA4 = flash_attn.Variant("fa4", "flash_attn.cute.interface", "flash-attn-4", "4.0.0b36", (9, 0), 11, 1)
H200 = AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16)
B200 = replace(H200, compute_capability=(10, 0))


def test_fa4_head_sizes_follow_its_limits_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash_attn, "installed_variants", lambda: (FA4,))
    for head in (64, 128, 192, 256):
        assert flash_attn.check(replace(H200, head_size=head)) == [], head
    for head in (64, 128, 256):
        assert flash_attn.check(replace(B200, head_size=head)) == [], head
    why = flash_attn.check(replace(B200, head_size=192))
    assert len(why) == 1 and "head size 192 not supported by fa4 on compute capability 10.x" in why[0]
    assert "head size 320 not supported" in flash_attn.check(replace(H200, head_size=320))[0]


def fa4_contract(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                 seqused_k: torch.Tensor, max_seqlen_q: int, page_table: torch.Tensor, softmax_scale: float,
                 causal: bool, softcap: float | None, window_size_left: int | None, num_splits: int,
                 out: torch.Tensor) -> tuple[torch.Tensor, None]:
    """4.0.0b36's argument checks for this call, then the attention it documents (see the module docstring)."""
    batch = cu_seqlens_q.shape[0] - 1
    num_pages, page_size, kv_heads, head = k.shape
    assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    assert page_table.shape == (batch, page_table.shape[1])
    assert v.shape == k.shape and q.dtype == k.dtype == out.dtype
    for t in (cu_seqlens_q, seqused_k):
        assert t.dtype == torch.int32 and t.stride(0) == 1
    assert seqused_k.shape == (batch,) and out.shape == q.shape and q.shape[0] == int(cu_seqlens_q[-1])
    assert q.shape[1] % kv_heads == 0 and causal and num_splits == 1  # SM 9.0 has no split-KV
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = q.shape[1] // kv_heads
    for b in range(batch):
        lo, hi, n_keys = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        slots = page_table[b].long()[:, None] * page_size + torch.arange(page_size)
        keys = k.reshape(-1, kv_heads, head)[slots.flatten()[:n_keys]].repeat_interleave(group, 1)
        vals = v.reshape(-1, kv_heads, head)[slots.flatten()[:n_keys]].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys.float()) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(hi - lo)[:, None] + n_keys - (hi - lo)
        k_pos = torch.arange(n_keys)[None, :]
        hidden = k_pos > q_pos
        if window_size_left is not None:
            hidden |= k_pos < q_pos - window_size_left
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals.float()).to(out.dtype)
    return out, None


@pytest.mark.parametrize("opts", [{}, {"sliding_window": 5}, {"logits_soft_cap": 2.0}], ids=str)
def test_fa4_arguments_match_the_torch_reference(opts: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(0)
    block, heads, kv_heads, head = 4, 8, 2, 16
    # decodes first (the engine's order), then a fresh prefill and a chunk after a cached prefix
    contexts, queries = [9, 3, 0, 6], [1, 1, 7, 5]
    num_blocks = 24
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for c, n in zip(contexts, queries, strict=True):
        need = -(-(c + n) // block)
        tables.append(perm[used : used + need])
        used += need
    common = prepare_inputs([list(range(c + n)) for c, n in zip(contexts, queries, strict=True)], contexts, queries,
                            tables, block, torch.device("cpu"), 2).attn
    t = sum(queries)
    q, k, v = (torch.randn(t, h, head, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks, block, kv_heads, head, generator=gen)
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5, opts.get("sliding_window"),
                                 opts.get("logits_soft_cap"))
    # The torch backend writes this step's K/V into the cache; FA4's call then reads the same pages.
    ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, cache, TorchSDPABackend.build_metadata(common))
    out = torch.full_like(q, float("nan"))
    FlashAttnImpl(layer, FA4, fa4_contract)._attend(q, cache, out, FlashAttnMetadata(common, None))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "graphs"), [("fa4", True), ("fa3", False), ("fa2", False)])
def test_only_fa4_declares_cuda_graphs(monkeypatch: pytest.MonkeyPatch, name: str, graphs: bool) -> None:
    """fa4 reads context lengths from device tensors only (capturable); fa2 takes max_seqlen_k as a host int a
    graph would freeze, fa3 never ran here: preload() declares graphs for the variant this GPU runs."""
    from pagedllm.plugins.attention.flash_attn import backend as fab

    variant = flash_attn.Variant(name, "m", "d", "1", (9, 0), 12, 1)
    monkeypatch.setattr(flash_attn, "installed_variants", lambda: [variant])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fab, "_loaded", lambda v: None)
    monkeypatch.setattr(fab.FlashAttnBackend, "supports_cuda_graphs", False)  # restored after the test
    fab.preload()
    assert fab.FlashAttnBackend.supports_cuda_graphs is graphs
    assert fab.FlashAttnBackend.cuda_graph_max_query_len == 1
