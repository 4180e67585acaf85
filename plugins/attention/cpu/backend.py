"""The `cpu` attention backend: paged attention in C (paged_attention.c) for bf16 and float32 CPU tensors.

Same cache layout as the torch reference -- kv_cache[0] = K, kv_cache[1] = V, each
[num_blocks, block_size, num_kv_heads, head], token slot s = block * block_size + offset -- so the two read
each other's caches and the conformance kit compares them slot for slot.

One C call per layer and step does what the reference does in several torch ops per request: it writes the
step's K/V rows at slot_mapping, then every request's query rows -- decodes and prefill chunks, cached prefix
included -- attend causally over its context through the block table, read in place (no gather copy), with
float32 accumulation, sliding window and soft-cap (paged_attention.c's NOTEs: work items, softmax, threads).

NOTE 1: why C, measured on the shared 2-core AVX512-BF16 EPYC (2026-12-01, load ~4, one thread, best of 20 calls
per layer, SmolLM2's 9 query / 3 KV heads of 64, pages of 16): 32 bf16 decodes over 320 tokens took the torch
backend 12.9 ms (its context gather and SDPA, for ~12 M multiply-adds), this kernel 0.63 ms; eight fresh prompts
of 32..256 tokens 12.9 ms against 4.4 ms, so prefill runs here too rather than in SDPA.
NOTE 2: the metadata (int32 and int64 tables, contiguous) is made once per step and read by every layer; the
per-layer call passes only ints to ctypes (paged_attention.py NOTE 1).
NOTE 3: a float32 model kept quantized brings its own C decode attention (AttentionLayerConfig.cpu_ops, the gguf
method's), which a model's one-token plan runs inside its one C call a step (the llama plugin's CpuDecodePlan,
through `c_decode_params` / `c_decode_step`). Decode-only steps run that kernel here too: the plan and the
modules then give the same bits whichever runs, and in a batch it is the faster of the two -- it reads each
cache row (every KV head of a position) once, where paged_attention.c's work items read one KV head's slice
of every row, and a decode step's cache rows come from memory behind the weights. The bench's batch (SmolLM2
GGUF, 32 decodes a step at 32..320 tokens, 2 threads, quiet machine, 2026-12-02, A B A B in one process):
46-50 ms a decode step with it, 62-65 ms with paged_attention.c (52-55 ms on one thread). Steps with prompts
or chunks run paged_attention.c (the torch backend's SDPA took ~5x as long for 8 fresh prompts).
NOTE 4: the cache may hold bf16 under a float32 model (`kv_cache.cache_dtype: bfloat16`, what `auto` picks for
a model kept quantized on the CPU: platform/cpu_compute.py NOTE 5): both C kernels round each new K/V row to
bf16 as they write it and widen cache rows to float32 as they read them, so a step reads half the bytes; the
queries, scores and outputs stay float32 (paged_attention.c NOTE 6, cpu_ops.c NOTE 9).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import torch

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention.cpu.paged_attention import DISABLE_ENV, paged_attention, unavailable_reason

_DTYPES = (torch.bfloat16, torch.float32)
# Below this many multiply-adds (~0.2 ms of one core's work here) a step's attention stays on the calling
# thread: a thread started and joined (tens of microseconds) would cost more than it saves (paged_attention.c
# NOTE 3).
MIN_WORK_PER_THREAD = 1 << 20


@dataclass
class CpuAttentionMetadata:
    """The step's tables as the C call reads them (int32 and int64, contiguous)."""

    common: CommonAttentionMetadata
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32, rows contiguous
    slot_mapping: torch.Tensor  # [T] int64
    rows: int  # query rows that belong to requests (query_start_loc[B]); rows past it are padding
    # Decodes only, one token each, no padding row (NOTE 3): `common` with the C calls' tables, else None.
    decodes_only: CommonAttentionMetadata | None = None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(device="cpu", dtype=dtype).contiguous()


def _rows_of_heads(x: torch.Tensor, head: int) -> torch.Tensor:
    """x [T, heads, head] with each row's heads packed (any row stride), as the C code reads it."""
    return x if x.stride(2) == 1 and x.stride(1) == head else x.contiguous()


class CpuAttentionImpl:
    """One layer: the K/V write and the attention of every request in one C call."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        if layer.sinks is not None or layer.attention_chunk_size is not None:
            # The Attention layer refuses both first (supports_sinks / supports_chunked_local are absent).
            raise ValueError("the cpu attention backend has neither attention sinks nor chunked local attention")
        fn = paged_attention()
        if fn is None:
            raise RuntimeError(
                f"the cpu attention backend's C kernel is unavailable ({unavailable_reason()}); "
                f"set attention.backend: torch (or {DISABLE_ENV}=0 to have the selector skip it)"
            )
        self._fn = fn
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = float(layer.scale)
        self.window = int(layer.sliding_window or 0)
        self.soft_cap = float(layer.logits_soft_cap or 0.0)
        self.cpu_ops: Any = layer.cpu_ops  # a quantized float32 model's own C kernels, or None (NOTE 3)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
    ) -> torch.Tensor:
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        dtype = query.dtype
        if dtype not in _DTYPES or key.dtype != dtype or value.dtype != dtype or kv_cache.dtype not in _DTYPES:
            raise ValueError(
                f"the cpu attention backend takes bfloat16 or float32 query, key and value of one dtype and a "
                f"bfloat16 or float32 KV cache; got {query.dtype}, {key.dtype}, {value.dtype} and a "
                f"{kv_cache.dtype} cache"
            )
        if query.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("the cpu attention backend needs CPU tensors and a contiguous KV cache")
        hs = self.head_size
        query, key, value = _rows_of_heads(query, hs), _rows_of_heads(key, hs), _rows_of_heads(value, hs)
        decodes = self.c_decode_step(query, key, value, kv_cache, metadata)
        if decodes is not None:
            return cast(torch.Tensor, self.cpu_ops.decode_attention(
                query, key, value, kv_cache, decodes.slot_mapping, decodes.block_table, decodes.seq_lens,
                self.scale, self.window or None, self.soft_cap or None,
            ))
        _, num_blocks, block_size, _, _ = kv_cache.shape
        out = torch.empty(query.shape[0], self.num_heads, hs, dtype=dtype)
        if metadata.rows < query.shape[0]:
            out[metadata.rows :].zero_()
        md = metadata
        rc = self._fn(
            query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            kv_cache.data_ptr(), num_blocks, block_size, self.num_kv_heads, hs, self.num_heads,
            md.slot_mapping.data_ptr(), md.common.num_actual_tokens, md.query_start_loc.data_ptr(),
            md.seq_lens.data_ptr(), md.block_table.data_ptr(), md.block_table.stride(0), md.common.num_reqs,
            self.scale, self.window, self.soft_cap, int(dtype == torch.bfloat16), int(kv_cache.dtype == torch.bfloat16),
            out.data_ptr(),
            torch.get_num_threads(), MIN_WORK_PER_THREAD,
        )
        if rc == -1:
            raise MemoryError("cpu_paged_attention: out of memory")
        if rc:
            raise ValueError(f"cpu_paged_attention: a slot or block id outside the {num_blocks}-block cache")
        return out

    def c_decode_params(self, ops: Any) -> tuple[float, int, float] | None:
        """(scale, window or 0, soft cap or 0) when this layer's decodes run `ops`' C decode attention
        (NOTE 3; AttentionImpl's optional CPU decode members), None otherwise."""
        if self.cpu_ops is None or self.cpu_ops is not ops:
            return None
        return self.scale, self.window, self.soft_cap

    def c_decode_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> CommonAttentionMetadata | None:
        """The step's common metadata, with the tables the C decode kernel reads, when this step's attention is
        `cpu_ops`' decode kernel (float32 decodes, a float32 or bf16 cache: NOTE 3, 4); None when it runs
        paged_attention.c."""
        if self.cpu_ops is None or type(metadata) is not CpuAttentionMetadata or metadata.decodes_only is None:
            return None
        if query.shape[0] != metadata.rows:
            return None
        if not query.dtype == key.dtype == value.dtype == torch.float32 or kv_cache.dtype not in _DTYPES:
            return None
        return metadata.decodes_only


class CpuAttentionBackend:
    """Paged attention in C for CPU tensors (bf16 or float32, the cache in either: NOTE 4): decodes and chunked
    prefill, GQA, sliding window, soft-cap. No sinks, no chunked local attention, no fp8 cache (the
    registration check refuses them)."""

    name: ClassVar[str] = "cpu"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """K and V stacked on a leading axis of 2, each in NHD block layout (the torch reference's)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        """The tables as the C call reads them, once per step (NOTE 2)."""
        qsl = _as(common.query_start_loc_cpu, torch.int32)
        seq_lens, block_table = _as(common.seq_lens_cpu, torch.int32), _as(common.block_table, torch.int32)
        slot_mapping = _as(common.slot_mapping, torch.int64)
        rows = int(qsl[common.num_reqs])
        decodes = common.num_decodes == common.num_reqs == rows == common.num_actual_tokens == slot_mapping.shape[0]
        return CpuAttentionMetadata(
            common=common,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            rows=rows,
            decodes_only=replace(common, seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping)
            if decodes and rows else None,
        )

    @staticmethod
    def make_impl(layer: AttentionLayerConfig) -> CpuAttentionImpl:
        """One impl per attention layer."""
        return CpuAttentionImpl(layer)


