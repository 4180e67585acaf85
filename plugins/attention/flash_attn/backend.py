"""The `flash_attn` attention backend: FlashAttention's paged varlen forward (fa4, fa3 or fa2; see flash_attn.py).

Cache layout: the torch/triton backends' [2, num_blocks, block_size, kv_heads, head]; kv_cache[0] and
kv_cache[1] are contiguous NHD page tensors, passed as separate K and V caches with the block table as the
page table. New K/V rows are written by the shared reshape_and_cache kernel (pagedllm.api.kernels). One call covers the
whole mixed batch (decodes and prefill chunks alike): queries by cu_seqlens_q = query_start_loc, context
lengths by seqused_k = seq_lens (fa2: cu_seqlens_k, their prefix sum), causal bottom-right aligned.

    fa4  flash_attn.cute.interface._flash_attn_fwd(q, k, v, cu_seqlens_q=, seqused_k=, max_seqlen_q=,
         page_table=, softmax_scale=, causal=True, softcap=, window_size_left=, num_splits=1, out=) -- the
         call the H200 anchor ran (fa4_test.py: page 16 and 128, 1.1e-3..2.3e-3 from float32; prefill
         382-445 TFLOP/s), keywords checked against 4.0.0b36's signature. It writes `out` in place and returns
         (out, lse, ...); lse stays None (not asked for).
    fa3  flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=,
         cu_seqlens_q=, max_seqlen_q=, softmax_scale=, causal=True, window_size=, softcap=)
    fa2  flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
         max_seqlen_k, softmax_scale=, causal=True, window_size=, softcap=, block_table=)

Windows: FlashAttention's left window counts the visible keys left of the query, so a window W is W - 1.
Metadata is device tensors plus two host ints (the step's longest query and context), so no host sync.

What was verified: on the H200 (examples/gpu/attn_backends_check.py --backends flash_attn, 2026-11-29)
fa4's outputs inside this class are 1.5e-3-2.0e-3 from the torch backend (mixed, decode, window, soft-cap),
greedy tokens on SmolLM2's real weights equal the torch backend's for 4 x 64 tokens, prefill 456-461 TFLOP/s,
decode 1.50-1.68 TB/s eagerly and 3.40 TB/s replayed from a CUDA graph (FlashAttnBackend NOTE); fa3 and fa2
are not installed there and have not run. Host cost: fa4's Python wrapper runs per layer per call (~0.1-0.2
ms before the launch; a soft-cap adds a source hash of a fresh score_mod closure per call) -- prefill pays it,
captured decode does not. FP8 KV is refused by the plugin's check.
Start-up costs are reported: the import ("flash_attn: using fa4 (...), imported in N s", INFO) and each new
fa4 kernel variant -- a CuTe DSL compile on the host, 3-6 s, seen as fa4's JIT cache growing during a call --
logged at INFO and kept in COMPILES (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED, set here, keeps compiled kernels
on disk for later processes). Each layer object's first forward is also timed with a device sync
(`first_call_s`).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention import flash_attn as registration

logger = logging.getLogger("pagedllm")


@dataclass
class FlashAttnMetadata:
    common: CommonAttentionMetadata
    cu_seqlens_k: torch.Tensor | None  # [B + 1] int32, fa2 only


class FlashAttnImpl:
    """One layer: reshape_and_cache, then one paged varlen call over the whole batch."""

    def __init__(self, layer: AttentionLayerConfig, variant: registration.Variant, fn: Any) -> None:
        self.variant, self.fn = variant, fn
        self.num_heads = layer.num_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.window_left = layer.sliding_window - 1 if layer.sliding_window else None
        self.soft_cap = layer.logits_soft_cap
        self._timed = False
        self.first_call_s: float | None = None  # the first forward's attention call, compile included

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
    ) -> torch.Tensor:
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        from pagedllm.api.kernels import reshape_and_cache

        common = metadata.common
        num_tokens = common.num_actual_tokens
        reshape_and_cache(key[:num_tokens], value[:num_tokens], kv_cache, common.slot_mapping)
        out = torch.zeros_like(query) if query.shape[0] > num_tokens else torch.empty_like(query)
        if not self._timed:  # the layer's first call, synced and timed (fa4: includes the first compile)
            torch.cuda.synchronize(query.device)
            t0 = time.perf_counter()
            self._attend(query[:num_tokens], kv_cache, out[:num_tokens], metadata)
            torch.cuda.synchronize(query.device)
            self._timed = True
            self.first_call_s = time.perf_counter() - t0
            logger.debug("flash_attn %s: first call took %.2f s", self.variant.name, self.first_call_s)
        else:
            self._attend(query[:num_tokens], kv_cache, out[:num_tokens], metadata)
        return out

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, md: FlashAttnMetadata) -> None:
        # q arrives as a strided view of the fused qkv rows; the kernels are only known to take packed rows.
        q = q.contiguous()
        common = md.common
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        reqs = common.num_reqs
        qsl = common.query_start_loc[: reqs + 1]
        seq_lens = common.seq_lens[:reqs]
        table = common.block_table[:reqs]
        name = self.variant.name
        if name == "fa4":
            known = _compiled_count(self.fn)
            t0 = time.perf_counter()
            # The anchor's keywords (fa4_test.py), plus softcap / window_size_left. num_splits=1: 4.0.0b36
            # asserts "SplitKV not supported on SM 9.0", and its heuristic (num_splits=0) picks > 1 for
            # small decode batches. max_seqlen_q (a host int) picks the one-M-block kernel for decode steps.
            self.fn(q, k_cache, v_cache, cu_seqlens_q=qsl, seqused_k=seq_lens, max_seqlen_q=common.max_query_len,
                    page_table=table, softmax_scale=self.scale, causal=True, softcap=self.soft_cap,
                    window_size_left=self.window_left, num_splits=1, out=out)
            if _compiled_count(self.fn) > known:  # a new kernel variant, compiled (or read from disk) on the host
                seconds = time.perf_counter() - t0
                COMPILES.append((f"max_query_len={common.max_query_len} requests={reqs}", seconds))
                logger.info("flash_attn fa4: new kernel variant for max_query_len=%d, %d requests: %.1f s "
                            "(compile or disk cache)", common.max_query_len, reqs, seconds)
            return
        window = (self.window_left if self.window_left is not None else -1, -1)
        if name == "fa3":
            res = self.fn(q, k_cache, v_cache, cache_seqlens=seq_lens, page_table=table, cu_seqlens_q=qsl,
                          max_seqlen_q=common.max_query_len, softmax_scale=self.scale, causal=True,
                          window_size=window, softcap=self.soft_cap or 0.0)
        else:
            res = self.fn(q, k_cache, v_cache, qsl, md.cu_seqlens_k, common.max_query_len, common.max_seq_len,
                          softmax_scale=self.scale, causal=True, window_size=window,
                          softcap=self.soft_cap or 0.0, block_table=table)
        out.copy_(res[0] if isinstance(res, tuple) else res)


# Every fa4 kernel variant this process compiled or loaded: (the step that needed it, host seconds).
COMPILES: list[tuple[str, float]] = []


def _compiled_count(fn: Any) -> int:
    """How many kernel variants fa4's in-memory JIT cache holds (`_flash_attn_fwd.compile_cache.cache`)."""
    return len(getattr(getattr(fn, "compile_cache", None), "cache", ()))


def _function(variant: registration.Variant) -> Any:
    """The variant's paged entry point, imported on first use (fa4's import alone takes 8-9 s)."""
    if variant.name == "fa4":
        # Keep compiled CuTe DSL kernels on disk for later processes (the anchor's compile-cache switch).
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    t0 = time.perf_counter()
    module = importlib.import_module(variant.module)
    logger.info("flash_attn: using %s, imported in %.1f s", variant.label(), time.perf_counter() - t0)
    attr = {"fa4": "_flash_attn_fwd", "fa3": "flash_attn_with_kvcache", "fa2": "flash_attn_varlen_func"}
    return getattr(module, attr[variant.name])


class FlashAttnBackend:
    """FlashAttention paged varlen: fp16/bf16, GQA, sliding window, soft-cap; fa4 decodes in CUDA graphs."""

    name: ClassVar[str] = "flash_attn"
    # NOTE (CUDA graphs): set by preload() for the variant this GPU runs. fa4's call takes the context lengths
    # as a device tensor (seqused_k) and, with num_splits=1, no host value that changes between decode steps
    # (max_seqlen_q is 1 in every decode graph), so a captured decode replays correctly with the step buffers
    # refilled; its Python front end (argument checks, compile-cache lookup: ~0.2 ms a call, which held its
    # eager decode to 1.50 TB/s against 1.6-2.1 standalone) then runs once per graph, not per step. fa2 takes
    # max_seqlen_k as a host int a graph would freeze, and fa3 has never run here: both stay eager.
    # Measured (H200, 64 x 2048 decode): 3.40 TB/s replayed vs 1.68 eager; engine W3 4.31 ms/token vs 24.97.
    supports_cuda_graphs: ClassVar[bool] = False
    cuda_graph_max_query_len: ClassVar[int] = 1  # decode graphs only; speculative q > 1 steps run eagerly

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The torch backend's layout: K and V stacked on a leading axis of 2, each NHD pages."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> FlashAttnMetadata:
        """fa2 also wants cumulative context lengths (computed on the device); the rest is the common tensors."""
        cu_k = None
        variant = _current_variant(common.block_table.device, common.block_size)
        if variant.name == "fa2":
            seq_lens = common.seq_lens[: common.num_reqs]
            cu_k = torch.nn.functional.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
        return FlashAttnMetadata(common, cu_k)

    @staticmethod
    def make_impl(layer: AttentionLayerConfig) -> FlashAttnImpl:
        """One impl per attention layer, bound to the variant this GPU uses."""
        device = torch.device("cuda", torch.cuda.current_device())
        variant = _current_variant(device, None)
        return FlashAttnImpl(layer, variant, _loaded(variant))


_functions: dict[str, Any] = {}


def preload() -> None:
    """Import the library this machine would use now, so a broken install fails when the backend is loaded."""
    variants = registration.installed_variants()
    if not variants:
        raise ImportError("no FlashAttention library is installed (see pagedllm.plugins.attention.flash_attn)")
    if torch.cuda.is_available():
        variant = _current_variant(torch.device("cuda", torch.cuda.current_device()), None)
        _loaded(variant)
        FlashAttnBackend.supports_cuda_graphs = variant.name == "fa4"  # the class NOTE
    else:
        _loaded(variants[0])


def _loaded(variant: registration.Variant) -> Any:
    if variant.name not in _functions:
        _functions[variant.name] = _function(variant)
    return _functions[variant.name]


def _current_variant(device: torch.device, block_size: int | None) -> registration.Variant:
    """The installed variant that runs on `device` (and `block_size`, when known); selection checked this."""
    cc = torch.cuda.get_device_capability(device)
    for variant in registration.installed_variants():
        if variant.min_cc <= cc and cc[0] <= variant.max_major and (
            block_size is None or block_size % variant.page_multiple == 0
        ):
            return variant
    raise RuntimeError(f"no installed FlashAttention variant runs on compute capability {cc}")
