"""The `flashinfer` attention backend: FlashInfer's paged decode and prefill wrappers over our cache layout.

Cache layout: the torch/triton backends' [2, num_blocks, block_size, kv_heads, head]; kv_cache[0] and
kv_cache[1] are each a contiguous NHD page tensor, handed to FlashInfer as the (k_cache, v_cache) tuple --
exactly what the H200 runs in ../shared/anchors/gpu-backends/fi_test.py used. New K/V rows are written by
the shared reshape_and_cache kernel (pagedllm.api.kernels; fp8-aware), not by FlashInfer.

Per step (NOTE 1): `build_metadata` turns the common metadata into FlashInfer's CSR page description once
(flashinfer_plan.py: host indptrs, device page ids, no device->host sync) and split decodes-first. Each
layer *kind* -- (heads, KV heads, head size, window, soft-cap, scale) -- needs its own plan(), since the
window and soft-cap are plan arguments; the first layer of a kind plans its wrappers, every later layer of
that kind in the step reuses them (one kind for Llama/Qwen, two for Gemma 2's local/global layers). Wrappers
and their workspaces persist across steps, one set per (device, kind): plan() is host-side work plus
non-blocking copies, run() launches the kernels.

    decode   BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True): the anchor's 4.0 TB/s configuration
             (64 x 2048 context, 32/8 heads, head 128, page 16) against 2.66 TB/s on CUDA cores.
    prefill  BatchPrefillWithPagedKVCacheWrapper(backend="auto"): FA3 kernels on Hopper, 475 TFLOP/s in the
             anchor (8 x 2048 causal); causal is bottom-right aligned, as our chunked prefill needs.

FP8 KV cache: kv_data_type float8_e4m3fn in plan(); run() gets k_scale / v_scale (FlashInfer folds k_scale
into the softmax scale and multiplies the output by v_scale). The query stays 16-bit.

What was verified, and what awaits the GPU (NOTE 2): the anchor scripts ran these exact wrapper calls on the
H200 (FlashInfer 0.6.8.post1 and 0.7.4) over this layout with random page ids, within bf16 rounding of a
float32 reference. This module's CSR construction is tested on the CPU against the torch backend
(tests/test_attention_selection.py). On the H200 (docs/benchmarks.md, issue 8) this class's forward ran
against the torch backend on mixed, window, soft-cap and fp8 batches within bf16 rounding and at 0.97x / 0.93x
of the anchor's decode / prefill speed (examples/gpu/attn_backends_check.py), and the engine's greedy tokens
on SmolLM2's real weights equal the torch backend's (4 prompts x 64 tokens, float16).

CUDA graphs (NOTE 3): pure-decode steps replay the runner's captured decode graphs, as vLLM's FlashInfer
backend does. For each captured batch size P the graph's metadata (`build_graph_metadata`) owns a
GraphDecodeBuffers (indptr [P + 1], indices [P x max blocks per request], last_page_len [P]) and, per layer
kind, a graph-mode decode wrapper over them (use_cuda_graph=True, tensor cores); the warm-up forward plans it,
the capture records its kernels. Before every replay the runner calls `prepare_graph_replay`, which re-plans
each of those wrappers with the step's padded CSR (flashinfer_plan NOTE 2: padding rows are 1-page requests on
the null block): host scheduling plus non-blocking copies into the fixed buffers and the wrapper's int
workspace, stream-ordered ahead of the replay, no device->host sync. In graph mode FlashInfer fixes the tile
size and grid for a batch size (split-KV always on), so the captured launch fits every re-plan. Mixed and
prefill steps (and speculative q > 1 steps: cuda_graph_max_query_len = 1) stay eager on the shared wrappers.
Every plan() first waits on an event recorded after the same wrapper's previous plan: plan() copies its
schedule out of the wrapper's page-locked buffer asynchronously, and with async scheduling the next step is
planned while the previous one's copies may still be queued.
Verified on the CPU (tests/test_flashinfer_graphs.py, against a stand-in for the wrapper that reads its graph
buffers as the captured kernels do) and on the H200 (examples/gpu/flashinfer_graph_check.py): replays equal
eager FlashInfer exactly and the torch backend within 3.1e-3, greedy tokens with graphs equal eager, W3 (8B)
4.93 ms/token with graphs vs 20.9 eager; each replay's plan() costs 0.5-0.8 ms of host time.
Cascade / shared-prefix attention is not used yet.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import flashinfer  # at the top: a named but broken install fails at selection.load(), naming this plugin
import torch

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention.flashinfer.plan import (
    GraphDecodeBuffers,
    PagedKVPart,
    PagedKVPlan,
    graph_decode_part,
    paged_kv_plan,
)

logger = logging.getLogger("pagedllm")

# Split-KV scratch of the decode/prefill kernels; the anchor ran with 256 MiB, vLLM's default is 256 MiB too.
_WORKSPACE_BYTES = 256 << 20
# One float workspace per device, shared by every wrapper: their run() calls are stream-ordered.
_workspaces: dict[torch.device, torch.Tensor] = {}
# Persistent wrappers per (device, layer kind, kv dtype, role); re-planned every step.
_wrappers: dict[tuple[Any, ...], Any] = {}
_first_use_logged: set[tuple[Any, ...]] = set()
# Per wrapper: recorded after its last plan() (NOTE 3: the page-locked schedule must be copied before reuse).
_plan_done: weakref.WeakKeyDictionary[Any, torch.cuda.Event] = weakref.WeakKeyDictionary()


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


class _Kind(NamedTuple):
    """What a plan() depends on besides the batch: layers of one kind share their planned wrappers."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    window_left: int
    soft_cap: float | None
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype

    def plan_kwargs(self) -> dict[str, Any]:
        return dict(window_left=self.window_left, logits_soft_cap=self.soft_cap, sm_scale=self.scale,
                    q_data_type=self.q_dtype, kv_data_type=self.kv_dtype)


@dataclass
class FlashInferMetadata:
    """The step's page plan and the wrappers planned for it so far (per layer kind).

    A decode graph's metadata (NOTE 3) also holds the graph's buffers and its own graph-mode wrappers.
    """

    common: CommonAttentionMetadata
    plan: PagedKVPlan
    planned: dict[_Kind, tuple[Any, Any]] = field(default_factory=dict)
    graph: GraphDecodeBuffers | None = None
    graph_wrappers: dict[_Kind, Any] = field(default_factory=dict)


class FlashInferImpl:
    """One layer: write K/V, then the decode wrapper on the leading decodes and the prefill wrapper on the rest."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        # FlashInfer's window_left counts the keys left of the query that stay visible: window W -> W - 1.
        self.window_left = layer.sliding_window - 1 if layer.sliding_window else -1
        self.soft_cap = layer.logits_soft_cap
        self.k_scale = 1.0  # fp8 KV cache: stored = x / scale (1.0 unless a loader sets them)
        self.v_scale = 1.0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        from pagedllm.api.kernels import is_fp8, reshape_and_cache

        common = metadata.common
        num_tokens = common.num_actual_tokens
        reshape_and_cache(
            key[:num_tokens], value[:num_tokens], kv_cache, common.slot_mapping, self.k_scale, self.v_scale
        )
        out = torch.zeros_like(query) if query.shape[0] > num_tokens else torch.empty_like(query)
        decode, prefill = self._planned(metadata, query.dtype, kv_cache.dtype)
        caches = (kv_cache[0], kv_cache[1])
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale} if is_fp8(kv_cache.dtype) else {}
        plan = metadata.plan
        if decode is not None and plan.decode is not None:
            rows = slice(plan.decode.query_start, plan.decode.query_end)
            self._run(decode, "decode", query[rows], caches, out[rows], scales)
        if prefill is not None and plan.prefill is not None:
            rows = slice(plan.prefill.query_start, plan.prefill.query_end)
            self._run(prefill, "prefill", query[rows], caches, out[rows], scales)
        return out

    def _kind(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> _Kind:
        return _Kind(self.num_heads, self.num_kv_heads, self.head_size, self.window_left, self.soft_cap,
                     self.scale, q_dtype, kv_dtype)

    def _planned(self, md: FlashInferMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[Any, Any]:
        """This layer kind's wrappers, planned for this step (NOTE 1: the first layer of the kind plans)."""
        kind = self._kind(q_dtype, kv_dtype)
        if kind in md.planned:
            return md.planned[kind]
        device = md.common.block_table.device
        page = md.common.block_size
        decode = prefill = None
        if md.plan.decode is not None:
            decode = _graph_wrapper(md, kind) if md.graph is not None else _wrapper(
                (device, kind, "decode"),
                lambda: flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(device), "NHD",
                                                                      use_tensor_cores=True))
            _plan_decode(decode, md.plan.decode, kind, page)
        if md.plan.prefill is not None:
            part = md.plan.prefill
            prefill = _wrapper((device, kind, "prefill"), lambda: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _workspace(device), "NHD", backend="auto"))
            _plan(prefill, device, part.qo_indptr_cpu, part.kv_indptr_cpu, part.kv_indices, part.last_page_len_cpu,
                  kind.num_heads, kind.num_kv_heads, kind.head_size, page, causal=True, **kind.plan_kwargs())
        md.planned[kind] = (decode, prefill)
        return decode, prefill

    @staticmethod
    def _run(wrapper: Any, role: str, q: torch.Tensor, caches: Any, out: torch.Tensor, scales: dict) -> None:
        q = q.contiguous()  # a strided view of the fused qkv rows; packed rows are what the anchor ran
        key = (id(wrapper), role)
        if key in _first_use_logged or q.device.type != "cuda":
            wrapper.run(q, caches, out=out, **scales)
            return
        # First use of a kernel compiles it (nvcc JIT: 11-100 s on a fresh machine, cached under
        # ~/.cache/flashinfer for later processes): time it once, with one sync, so start-up says so.
        torch.cuda.synchronize(q.device)
        t0 = time.perf_counter()
        wrapper.run(q, caches, out=out, **scales)
        torch.cuda.synchronize(q.device)
        _first_use_logged.add(key)
        logger.info("flashinfer %s: first run (JIT compile or cache load) took %.1f s", role,
                    time.perf_counter() - t0)


def _wrapper(key: tuple[Any, ...], make: Any) -> Any:
    if key not in _wrappers:
        _wrappers[key] = make()
    return _wrappers[key]


def _graph_wrapper(md: FlashInferMetadata, kind: _Kind) -> Any:
    """The graph-mode decode wrapper of this graph and layer kind, over the graph's fixed buffers (NOTE 3)."""
    graph = md.graph
    assert graph is not None
    if kind not in md.graph_wrappers:
        md.graph_wrappers[kind] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(graph.kv_indptr.device), "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=graph.kv_indptr, paged_kv_indices_buffer=graph.kv_indices,
            paged_kv_last_page_len_buffer=graph.last_page_len)
    return md.graph_wrappers[kind]


def _plan_decode(wrapper: Any, part: PagedKVPart, kind: _Kind, page: int) -> None:
    _plan(wrapper, part.kv_indices.device, part.kv_indptr_cpu, part.kv_indices, part.last_page_len_cpu, kind.num_heads,
          kind.num_kv_heads, kind.head_size, page, **kind.plan_kwargs())


def _plan(wrapper: Any, device: torch.device, *args: Any, **kwargs: Any) -> None:
    """wrapper.plan(...), after the same wrapper's previous plan has left its page-locked buffer (NOTE 3)."""
    if device.type != "cuda":
        wrapper.plan(*args, **kwargs)
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flashinfer: plan() inside a CUDA graph capture (the warm-up forward must plan)")
    done = _plan_done.get(wrapper)
    if done is None:
        done = _plan_done[wrapper] = torch.cuda.Event()
    done.synchronize()  # normally long past: the copies ran ahead of the previous step's kernels
    wrapper.plan(*args, **kwargs)
    done.record()


class FlashInferBackend:
    """FlashInfer paged attention: fp16/bf16 (fp8 KV cache), GQA, sliding window, soft-cap; decode-only steps
    inside CUDA graphs (NOTE 3)."""

    name: ClassVar[str] = "flashinfer"
    supports_cuda_graphs: ClassVar[bool] = True  # NOTE 3
    cuda_graph_max_query_len: ClassVar[int] = 1  # multi-token steps use the prefill wrapper: eager

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The torch backend's layout: K and V stacked on a leading axis of 2, each NHD pages."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> FlashInferMetadata:
        """FlashInfer's CSR page description of the step, split decodes-first (no device reads)."""
        return FlashInferMetadata(common, paged_kv_plan(common))

    @staticmethod
    def build_graph_metadata(common: CommonAttentionMetadata) -> FlashInferMetadata:
        """A decode graph's metadata (NOTE 3): buffers for common.num_reqs requests of up to the block table's
        width in pages each; its graph-mode wrappers are made and planned by the warm-up forward."""
        buffers = GraphDecodeBuffers.allocate(common.num_reqs, common.block_table.shape[1],
                                              common.block_table.device)
        return FlashInferMetadata(common, PagedKVPlan(graph_decode_part(common, buffers), None), graph=buffers)

    @staticmethod
    def prepare_graph_replay(metadata: FlashInferMetadata, common: CommonAttentionMetadata) -> None:
        """Before a replay: re-plan the graph's wrappers, one per layer kind, for this padded step (NOTE 3)."""
        assert metadata.graph is not None, "not a graph's metadata (build_graph_metadata)"
        part = graph_decode_part(common, metadata.graph)
        for kind, (decode, _) in metadata.planned.items():
            _plan_decode(decode, part, kind, common.block_size)

    @staticmethod
    def make_impl(layer: AttentionLayerConfig) -> FlashInferImpl:
        """One impl per attention layer."""
        return FlashInferImpl(layer)
