"""Decode CUDA graphs with per-replay planning (cuda_graphs.py NOTE 6), checked on the CPU.

torch's CUDA-graph API is replaced by a recorder: "capture" records each model call with its arguments and
output tensor, "replay" calls them again with the same arguments and writes the same output tensor -- what a
replay does with fixed addresses. Host logic inside the forward runs again too, so the FlashInfer stand-in's
run() reads nothing but its wrapper's buffers, as the captured kernels do: a replay that skipped the re-plan
would read the previous step's pages (test_replay_without_the_hook_reads_stale_pages shows it).

The FlashInfer stand-in follows BatchDecodeWithPagedKVCacheWrapper of FlashInfer 0.6.8.post1 (decode.py) as
far as the backend uses it: graph mode copies plan()'s indptr / indices / last_page_len into the caller's fixed
buffers and refuses another batch size or more pages than the indices buffer holds; run() attends over
exactly those buffers. The attention itself is checked against the torch backend, nobody's stand-in.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from pagedllm.plugins.attention.flashinfer.plan import GraphDecodeBuffers, graph_decode_part
from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.worker.cuda_graphs import DecodeGraphs, StepBuffers
from pagedllm.worker.input_prep import plan_inputs, prepare_inputs

CPU = torch.device("cpu")
BLOCK, HEADS, KV_HEADS, HEAD = 4, 4, 2, 16
LOG: list[tuple[Any, ...]] = []


class _Graph:
    """torch.cuda.CUDAGraph's stand-in: replays the recorded model calls into their captured outputs."""

    capturing: ClassVar[_Graph | None] = None

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...], torch.Tensor]] = []

    def replay(self) -> None:
        LOG.append(("replay", self.calls[0][2].shape[0]))
        for fn, args, out in self.calls:
            out.copy_(fn(*args))

    def reset(self) -> None:
        self.calls.clear()


@contextlib.contextmanager
def _capture(graph: _Graph, pool: Any = None) -> Iterator[None]:
    _Graph.capturing = graph
    try:
        yield
    finally:
        _Graph.capturing = None


class _Model:
    """Calls `fn(input_ids, positions, metadata, kv_caches)`; inside a capture, records the call."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> torch.Tensor:
        out = self.fn(*args)
        LOG.append(("forward", args[0].shape[0], "capture" if _Graph.capturing else "eager"))
        if _Graph.capturing is not None:
            _Graph.capturing.calls.append((self.fn, args, out))
        return out


@pytest.fixture
def fake_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    LOG.clear()
    yield
    LOG.clear()


def _decode_host(seq_lens: list[int], blocks: list[list[int]]) -> Any:
    """A decode-only step: request i has seq_lens[i] tokens, the last one new, in blocks[i]."""
    tokens = [list(range(n)) for n in seq_lens]
    return plan_inputs(tokens, [n - 1 for n in seq_lens], [1] * len(seq_lens), blocks, BLOCK, len(seq_lens))


# ------------------------------------------------------------------------------------- the generic hook


class _HookedBackend:
    supports_cuda_graphs = True
    cuda_graph_max_query_len = 1

    @staticmethod
    def build_metadata(common: Any) -> Any:
        raise AssertionError("graphs of a backend with the hook are captured with build_graph_metadata")

    @staticmethod
    def build_graph_metadata(common: Any) -> dict[str, int]:
        LOG.append(("build_graph_metadata", common.num_reqs))
        return {"size": common.num_reqs}

    @staticmethod
    def prepare_graph_replay(metadata: dict[str, int], common: Any) -> None:
        LOG.append(("prepare", metadata["size"], common.num_reqs, common.seq_lens_cpu.tolist(), common.block_size))


class _PlainBackend:
    supports_cuda_graphs = True

    @staticmethod
    def build_metadata(common: Any) -> str:
        LOG.append(("build_metadata", common.num_reqs))
        return "plain"


def _graphs(backend: Any, query_lens: tuple[int, ...] = (3,)) -> DecodeGraphs:
    buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=4, device=CPU)
    graphs = DecodeGraphs(_Model(lambda ids, pos, md, caches: torch.zeros(ids.shape[0], 2)), backend, [],
                          buffers)
    graphs.capture([1, 2, 4], [BLOCK], query_lens)
    return graphs


def test_the_hook_runs_once_before_each_replay_with_the_padded_step(fake_cuda_graphs: None) -> None:
    graphs = _graphs(_HookedBackend)
    # cuda_graph_max_query_len = 1: no graphs for the speculative q = 3 steps the runner asked for.
    assert graphs.sizes_by_query_len == {1: [1, 2, 4]}
    assert [e for e in LOG if e[0] == "build_graph_metadata"] == [("build_graph_metadata", s) for s in (4, 2, 1)]
    # each size: warm-up forward, then the captured one, both on the metadata the graph keeps
    assert [e[1:] for e in LOG if e[0] == "forward"] == [(s, m) for s in (4, 2, 1) for m in ("eager", "capture")]

    LOG.clear()
    got = graphs.run(_decode_host([10, 5, 4], [[3, 4, 5], [6, 7], [8]]))
    assert got is not None and got[1].shape[0] == 4
    assert LOG == [("prepare", 4, 4, [10, 5, 4, 1], BLOCK), ("replay", 4)]  # padding request: seq_len 1

    LOG.clear()
    graphs.run(_decode_host([3, 9], [[1], [2, 3, 9]]))
    assert LOG == [("prepare", 2, 2, [3, 9], BLOCK), ("replay", 2)]

    LOG.clear()  # a step with a prefill (or q = 3 uniform) finds no graph: no re-plan either
    mixed = plan_inputs([list(range(5)), list(range(6))], [4, 0], [1, 6], [[1, 2], [3, 4]], BLOCK, 1)
    assert graphs.run(mixed) is None
    assert graphs.run(plan_inputs([list(range(9))], [6], [3], [[1, 2, 3]], BLOCK, 0)) is None
    assert LOG == []


def test_hybrid_models_get_the_hook_once_per_kv_cache_group(fake_cuda_graphs: None) -> None:
    buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=4, device=CPU, num_groups=2)
    graphs = DecodeGraphs(_Model(lambda ids, pos, md, caches: torch.zeros(ids.shape[0], 2)), _HookedBackend, [],
                          buffers)
    graphs.capture([4], [BLOCK, 2 * BLOCK])
    LOG.clear()
    seq_lens, blocks = [10, 5], [[3, 4, 5], [6, 7]]
    host = plan_inputs([list(range(n)) for n in seq_lens], [n - 1 for n in seq_lens], [1, 1], blocks, BLOCK, 2,
                       [([[9, 10], [11]], 2 * BLOCK)])
    graphs.run(host)
    expected = [("prepare", 4, 4, [10, 5, 1, 1], b) for b in (BLOCK, 2 * BLOCK)]  # each group, its blocks
    assert [*expected, ("replay", 4)] == LOG


def test_backends_without_the_hook_capture_and_replay_as_before(fake_cuda_graphs: None) -> None:
    graphs = _graphs(_PlainBackend)
    assert graphs.sizes_by_query_len == {1: [1, 2, 4], 3: [1, 2, 4]}
    assert [e for e in LOG if e[0] == "build_metadata"] == [("build_metadata", s) for s in (4, 2, 1) * 2]
    LOG.clear()
    graphs.run(_decode_host([10, 5, 4], [[3, 4, 5], [6, 7], [8]]))
    assert LOG == [("replay", 4)]


# ------------------------------------------------------------------------------- the padded page plan


def test_padded_decode_plan_matches_the_hand_computed_csr() -> None:
    buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=8, device=CPU)
    # a bigger earlier step leaves stale block-table columns behind the padding rows' block 0
    buffers.load(plan_inputs([list(range(30))] * 4, [0] * 4, [4] * 4, [list(range(9, 17))] * 4, BLOCK, 0))
    common = buffers.load(_decode_host([10, 5, 4], [[3, 4, 5], [6, 7], [8]]), pad_to=4).attn
    graph = GraphDecodeBuffers.allocate(4, common.block_table.shape[1], CPU)
    assert (graph.kv_indptr.numel(), graph.kv_indices.numel(), graph.last_page_len.numel()) == (5, 32, 4)

    part = graph_decode_part(common, graph)
    # pages: ceil(10/4) = 3, ceil(5/4) = 2, 1, and the padding request's one page (the null block 0)
    assert part.kv_indptr_cpu.tolist() == [0, 3, 5, 6, 7]
    assert part.kv_indices.tolist() == [3, 4, 5, 6, 7, 8, 0]
    assert part.last_page_len_cpu.tolist() == [2, 1, 4, 1]  # 10 = 2 * 4 + 2, 5 = 4 + 1, a full page, 1
    assert (part.num_reqs, part.query_start, part.query_end) == (4, 0, 4)

    with pytest.raises(ValueError, match="decode graph of 2 requests"):  # another size than the graph's
        graph_decode_part(common, GraphDecodeBuffers.allocate(2, 8, CPU))
    with pytest.raises(ValueError, match="exceed"):  # more pages than the indices buffer holds
        graph_decode_part(common, GraphDecodeBuffers(4, graph.kv_indptr, graph.kv_indices[:6], graph.last_page_len))
    mixed = plan_inputs([list(range(5)), list(range(6))], [4, 0], [1, 6], [[1, 2], [3, 4]], BLOCK, 1)
    with pytest.raises(ValueError, match="1 decodes"):
        graph_decode_part(buffers.load(mixed).attn, GraphDecodeBuffers.allocate(2, 8, CPU))


# ---------------------------------------------------------------- the flashinfer backend under "graphs"


class _DecodeWrapper:
    """BatchDecodeWithPagedKVCacheWrapper (FlashInfer 0.6.8.post1) as the backend uses it; see the docstring."""

    made: ClassVar[list[_DecodeWrapper]] = []

    def __init__(self, workspace: torch.Tensor, layout: str, use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: Any = None,
                 paged_kv_indices_buffer: Any = None, paged_kv_last_page_len_buffer: Any = None) -> None:
        assert layout == "NHD" and use_tensor_cores
        self.graph = use_cuda_graph
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last = paged_kv_last_page_len_buffer
        if use_cuda_graph:  # decode.py: all three buffers, indptr one longer than last_page_len
            assert self.indptr is not None and self.indices is not None and self.last is not None
            assert len(self.indptr) == len(self.last) + 1
        self.plans = 0
        _DecodeWrapper.made.append(self)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, window_left: int, logits_soft_cap: Any,
             sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype) -> None:
        assert _Graph.capturing is None, "plan() inside a capture"
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"  # read on the host
        assert (num_qo_heads, num_kv_heads, head_dim, window_left, logits_soft_cap) == (HEADS, KV_HEADS, HEAD,
                                                                                        -1, None)
        if self.graph:
            if len(last_page_len) != len(self.last):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self.indices):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self.indptr.copy_(indptr)
            self.last.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last_page_len.clone()
        self.page, self.scale = page_size, sm_scale
        self.plans += 1

    def run(self, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        assert q.shape[0] == len(self.last)
        group = HEADS // KV_HEADS
        for i in range(len(self.last)):
            pages = self.indices[int(self.indptr[i]) : int(self.indptr[i + 1])].long()
            n_keys = (len(pages) - 1) * self.page + int(self.last[i])
            k, v = (c[pages].reshape(-1, KV_HEADS, HEAD)[:n_keys].repeat_interleave(group, 1) for c in caches)
            p = torch.softmax(torch.einsum("hd,khd->hk", q[i], k) * self.scale, -1)
            out[i] = torch.einsum("hk,khd->hd", p, v)
        return out


@pytest.fixture
def flashinfer_backend(monkeypatch: pytest.MonkeyPatch, fake_cuda_graphs: None) -> Iterator[Any]:
    """The real flashinfer_backend module, imported against the stand-in `flashinfer` (and removed after)."""
    import pagedllm.api.kernels as toolkit  # the backend writes K/V with the toolkit's reshape_and_cache

    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _DecodeWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)

    def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0, slots], flat[1, slots] = key, value

    monkeypatch.setattr(toolkit, "reshape_and_cache", write_kv)
    package, name = importlib.import_module("pagedllm.plugins.attention"), "pagedllm.plugins.attention.flashinfer.backend"
    previous = sys.modules.pop(name, None)
    _DecodeWrapper.made.clear()
    try:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "_WORKSPACE_BYTES", 16)
        yield module
    finally:  # neither sys.modules nor the package keeps the module bound to the stand-in
        sys.modules.pop(name, None)
        package.__dict__.pop("flashinfer_backend", None)
        if previous is not None:
            sys.modules[name] = previous
            package.__dict__["flashinfer_backend"] = previous


class _Step:
    """A decode graph of one flashinfer attention layer over persistent q/k/v rows (the graph's inputs)."""

    def __init__(self, module: Any, num_blocks: int = 24) -> None:
        gen = torch.Generator().manual_seed(0)
        self.layer = AttentionLayerConfig(HEADS, HEAD, KV_HEADS, HEAD**-0.5)
        self.impl = module.FlashInferBackend.make_impl(self.layer)
        self.cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD, generator=gen)
        # zeros, not empty: the capture writes these rows into the null block, which the torch reference's
        # padded block tables read (masked -- but a garbage key can overflow its score to inf, and inf - inf).
        self.q, self.k, self.v = (torch.zeros(16, h, HEAD) for h in (HEADS, KV_HEADS, KV_HEADS))
        self.gen = gen

        def forward(ids: torch.Tensor, pos: torch.Tensor, md: Any, caches: list[torch.Tensor]) -> torch.Tensor:
            n = ids.shape[0]
            return self.impl.forward(self.q[:n], self.k[:n], self.v[:n], caches[0], md)

        buffers = StepBuffers(max_tokens=16, max_reqs=4, max_blocks=8, device=CPU)
        self.graphs = DecodeGraphs(_Model(forward), module.FlashInferBackend, [self.cache], buffers)
        self.graphs.capture([2, 4], [BLOCK], (3,))

    def check(self, seq_lens: list[int], blocks: list[list[int]]) -> float:
        """Replay one decode step; max |graph - torch backend| over its real rows."""
        n = len(seq_lens)
        for t in (self.q, self.k, self.v):
            t.normal_(generator=self.gen)
        before = self.cache.clone()
        got = self.graphs.run(_decode_host(seq_lens, blocks))
        assert got is not None
        fresh = prepare_inputs([list(range(s)) for s in seq_lens], [s - 1 for s in seq_lens], [1] * n, blocks,
                               BLOCK, CPU, n).attn
        ref = TorchSDPABackend.make_impl(self.layer).forward(self.q[:n], self.k[:n], self.v[:n], before,
                                                             TorchSDPABackend.build_metadata(fresh))
        return float((got[1][:n] - ref).abs().max())


def test_flashinfer_decode_graphs_replay_each_step_like_the_torch_backend(flashinfer_backend: Any) -> None:
    step = _Step(flashinfer_backend)
    assert step.graphs.sizes_by_query_len == {1: [2, 4]}  # decode graphs only (cuda_graph_max_query_len)
    made = list(_DecodeWrapper.made)
    # one graph-mode wrapper per captured size, over buffers for that size x 8 pages, planned once (warm-up)
    assert [(w.graph, len(w.indptr), len(w.indices), len(w.last), w.plans) for w in made] == [
        (True, 5, 32, 4, 1), (True, 3, 16, 2, 1)]
    # replays of the size-4 graph, with other lengths and pages each time (a padding row in the first)
    assert step.check([10, 5, 4], [[3, 4, 5], [6, 7], [8]]) < 1e-5
    assert step.check([13, 2, 7, 16], [[9, 10, 11, 12], [13], [14, 15], [16, 17, 18, 19]]) < 1e-5
    assert step.check([1, 30], [[20], [1, 2, 3, 4, 5, 6, 7, 21]]) < 1e-5  # the size-2 graph
    assert [w.plans for w in made] == [3, 2]  # once per replay of its graph, nothing else
    assert _DecodeWrapper.made == made  # replays made no wrapper


def test_replay_without_the_hook_reads_stale_pages(flashinfer_backend: Any) -> None:
    """The control: skip the re-plan and the same replay attends over the previous step's pages."""
    step = _Step(flashinfer_backend)
    assert step.check([10, 5, 4], [[3, 4, 5], [6, 7], [8]]) < 1e-5
    step.graphs._prepare_replay = None
    assert step.check([13, 2, 7, 16], [[9, 10, 11, 12], [13], [14, 15], [16, 17, 18, 19]]) > 1e-2
