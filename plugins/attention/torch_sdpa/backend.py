"""The reference paged-attention backend in plain PyTorch: the correctness oracle for the kernel backends.

Cache layout, per layer: kv_cache[0] = K, kv_cache[1] = V, each [num_blocks, block_size, num_kv_heads, head].
Viewed flat as [num_blocks * block_size, ...], token slot s = block * block_size + offset is row s.

Each step the impl (1) writes the new K/V rows at slot_mapping, then (2) reads every request's whole context
back through its block table -- cached tokens of earlier steps, prefix-cache hits, earlier chunks and the
new tokens alike -- and attends causally:

    context of request i:  positions 0 .. seq_len-1      (the last query_len of them are this step's)
    query row j (0-based within the request) sits at position seq_len - query_len + j and may see
    key position p when  p <= that position  and, with a sliding window W,  p > that position - W,
    or, with chunked local attention of chunk C (Llama 4),  p // C == that position // C.

Contexts are read a whole block at a time (block_table rows index kv_cache[:, block]), not slot by slot:
contiguous block_size-token reads instead of one gather per token. Decodes (the leading num_decodes
requests, one query each) are batched over a padded [D, L = blocks * block_size] grid with a validity mask;
prefills run one request at a time through SDPA. Scores and softmax are computed in float32 whatever the
model dtype (the oracle favours accuracy over speed), except for a bfloat16 model's decodes on the CPU: there
SDPA reads the bf16 cache as it is (it accumulates in float32) rather than an upcast copy of every context
each layer (SmolLM2, 16 decodes a step: 234 ms of bf16 bmm against 314 ms in float32, and half the gather
bytes). Prefill stays float32 (`_prefill`'s NOTE).

Attention sinks (AttentionLayerConfig.sinks, gpt-oss): head h's learned logit s_h joins every softmax as one
more column with no value, as transformers' eager gpt-oss attention does:
    p = softmax([scores | s_h])[:-1]      (so sum(p) = 1 - exp(s_h) / (sum(exp(scores)) + exp(s_h)))
SDPA cannot add that column, so layers with sinks take the spelled-out path that soft-capping takes.

FP8 KV cache (float8_e4m3fn): rows are stored as clamp(x / scale, +-448) with one scale for K and one for V
per layer (`k_scale`, `v_scale` on the impl, 1.0 unless a loader sets them) and read back as
float32 * scale -- the same arithmetic as the Triton kernels, so the two backends write identical caches.
torch has no CPU index_copy_/index_select for float8, so the cache is moved through a uint8 view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata


@dataclass
class PrefillSegment:
    """One non-decode request: its query rows, context length, context blocks and causal mask."""

    query_start: int
    query_end: int
    context_len: int
    blocks: torch.Tensor  # [ceil(context_len / block_size)] int64: the request's blocks, in order
    causal_mask: torch.Tensor  # [query_len, context_len] bool, True = may attend
    query_positions: torch.Tensor  # [query_len] int64
    key_positions: torch.Tensor  # [context_len] int64


@dataclass
class TorchSDPAMetadata:
    """The common metadata plus the gather plans shared by every layer of the step."""

    common: CommonAttentionMetadata
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [D, L / block_size] int64 block ids (0 where padding)
    decode_valid: torch.Tensor | None = None  # [D, L] bool: position < seq_len
    decode_seq_lens: torch.Tensor | None = None  # [D] int64
    decode_key_positions: torch.Tensor | None = None  # [L] int64
    decode_common_len: int | None = None  # every decode's seq_len when they are all equal (e.g. just one)
    decode_first_block: int | None = None  # one decode whose blocks are consecutive ids: the first of them
    prefills: list[PrefillSegment] = field(default_factory=list)
    c_decode: bool | None = None  # whether the C decode kernel takes this step (TorchSDPAImpl._c_decode)


_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _store(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """Write rows at slots of one flat [slots, kv_heads, head] cache view (fp8: quantized with `scale`)."""
    if _is_fp8(flat.dtype):
        quant = (rows.float() * (1.0 / scale)).clamp_(-_FP8_MAX, _FP8_MAX).to(flat.dtype)
        flat.view(torch.uint8).index_copy_(0, slots, quant.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, rows.to(flat.dtype))


def _compute_dtype(query: torch.Tensor, plain: bool) -> torch.dtype:
    """The dtype decode attention runs in: the model's bf16 on the CPU where SDPA computes it (the module
    docstring), float32 otherwise."""
    if plain and query.dtype == torch.bfloat16 and query.device.type == "cpu":
        return torch.bfloat16
    return torch.float32


def _gather_context(
    kv_cache: torch.Tensor, blocks: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks in `dtype` [..., n_blocks * block_size, kv_heads, head] (one gather).

    NOTE: index_select on a [2, num_blocks, block bytes] view copies whole blocks; on the CPU it is several
    times faster than advanced indexing with a 2-D index, and this gather is most of a decode step's attention.
    """
    two, num_blocks, block_size, kv_heads, head = kv_cache.shape
    fp8 = _is_fp8(kv_cache.dtype)
    flat = (kv_cache.view(torch.uint8) if fp8 else kv_cache).view(two, num_blocks, block_size * kv_heads * head)
    kv = flat.index_select(1, blocks.reshape(-1))
    kv = kv.view(kv_cache.dtype).float() if fp8 else kv.to(dtype)
    kv = kv.view(two, *blocks.shape[:-1], blocks.shape[-1] * block_size, kv_heads, head)
    if fp8:
        return kv[0] * k_scale, kv[1] * v_scale
    return kv[0], kv[1]


class TorchSDPAImpl:
    """One layer's kernel: write K/V, then decode batch + per-request prefill attention."""

    def __init__(self, layer: AttentionLayerConfig) -> None:
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.sliding_window = layer.sliding_window
        self.soft_cap = layer.logits_soft_cap
        self.sinks = layer.sinks  # [num_heads] or None; the model's parameter, read at every call
        self.chunk_size = layer.attention_chunk_size  # chunked local attention (the module docstring), or None
        self.group = layer.num_heads // layer.num_kv_heads
        self.k_scale = 1.0  # fp8 KV cache only: stored = x / scale (see the module docstring)
        self.v_scale = 1.0
        # The CPU fused C kernels when the engine built this model with them (AttentionLayerConfig.cpu_ops,
        # pagedllm.layers.fused_ops NOTE 3): decode-only float32 steps then write and attend in one C call.
        self.cpu_ops: Any = layer.cpu_ops

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchSDPAMetadata,
    ) -> torch.Tensor:
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        common = metadata.common
        num_tokens = common.num_actual_tokens
        if self.cpu_ops is not None and (
            metadata.c_decode if metadata.c_decode is not None else self._c_decode(query, key, value, kv_cache, metadata)
        ):
            return cast(torch.Tensor, self.cpu_ops.decode_attention(
                query, key, value, kv_cache, common.slot_mapping, common.block_table, common.seq_lens,
                self.scale, self.sliding_window, self.soft_cap,
            ))
        # Flat views share storage with kv_cache, so index_copy_ writes the paged cache in place.
        k_flat = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        v_flat = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        # Rows past num_actual_tokens are padding (e.g. for a captured graph) and are neither stored nor read.
        slots = common.slot_mapping[:num_tokens]
        _store(k_flat, slots, key[:num_tokens], self.k_scale)
        _store(v_flat, slots, value[:num_tokens], self.v_scale)

        num_decodes = metadata.num_decodes
        if num_decodes == query.shape[0] and not metadata.prefills:  # a decode-only step, no padding rows
            return self._decode(query, kv_cache, metadata).to(query.dtype)
        out = torch.zeros_like(query)
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], kv_cache, metadata).to(out.dtype)
        for seg in metadata.prefills:
            rows = slice(seg.query_start, seg.query_end)
            out[rows] = self._prefill(query[rows], kv_cache, seg).to(out.dtype)
        return out

    def c_decode_params(self, ops: Any) -> tuple[float, int, float] | None:
        """(scale, window or 0, soft cap or 0) when this layer's decode runs `ops`' C decode attention over the
        engine's paged cache (AttentionImpl's optional CPU decode members), None otherwise."""
        if self.cpu_ops is None or self.cpu_ops is not ops or self.sinks is not None or self.chunk_size is not None:
            return None  # the C kernel has neither sinks nor chunks
        return float(self.scale), int(self.sliding_window or 0), float(self.soft_cap or 0.0)

    def c_decode_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> CommonAttentionMetadata | None:
        """This step's common metadata when its attention is the C decode kernel (asked as `forward`'s first
        layer asks it), None when the step goes another way."""
        if self.cpu_ops is None or type(metadata) is not TorchSDPAMetadata:
            return None
        take = metadata.c_decode if metadata.c_decode is not None else self._c_decode(query, key, value, kv_cache, metadata)
        return metadata.common if take else None

    def _c_decode(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        md: TorchSDPAMetadata,
    ) -> bool:
        """Whether cpu_decode_attention takes this step: decodes only, no padding rows, float32 throughout, and
        the layouts the C code reads (rows of whole heads; int32 tables, int64 slots). Asked by the step's
        first layer; the rest read the answer from the metadata (every layer of a group has the same layout)."""
        common = md.common
        hs = self.head_size
        md.c_decode = (
            self.sinks is None
            and self.chunk_size is None
            and md.num_decodes == query.shape[0] == common.num_actual_tokens
            and not md.prefills
            and kv_cache.dtype == query.dtype == key.dtype == value.dtype == torch.float32
            and kv_cache.is_contiguous()
            and query.stride(2) == key.stride(2) == value.stride(2) == 1
            and query.stride(1) == key.stride(1) == value.stride(1) == hs
            and common.block_table.dtype == common.seq_lens.dtype == torch.int32
            and common.block_table.stride(1) == 1
            and common.seq_lens.stride(0) == 1
            and common.slot_mapping.dtype == torch.int64
            and common.slot_mapping.stride(0) == 1
        )
        return md.c_decode

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, md: TorchSDPAMetadata) -> torch.Tensor:
        assert md.decode_blocks is not None and md.decode_valid is not None
        assert md.decode_seq_lens is not None and md.decode_key_positions is not None
        num_decodes = query.shape[0]
        plain = self.soft_cap is None and self.sinks is None  # SDPA computes it
        cdt = _compute_dtype(query, plain)
        if md.decode_first_block is not None and not _is_fp8(kv_cache.dtype):
            # NOTE: a lone request's blocks are often consecutive ids (a fresh pool hands them out in order):
            # then its context is a view of the cache, no gather copy (the gather was ~55 us per layer).
            assert md.decode_blocks is not None
            start, count = md.decode_first_block, md.decode_blocks.shape[1]
            two, _, block_size, kv_heads, head = kv_cache.shape
            kv = kv_cache[:, start : start + count].reshape(two, 1, count * block_size, kv_heads, head).to(cdt)
            k, v = kv[0], kv[1]
        else:
            k, v = _gather_context(kv_cache, md.decode_blocks, self.k_scale, self.v_scale, cdt)  # [D, L, kvh, head]
        if md.decode_common_len is not None and self.sliding_window is None and self.chunk_size is None and plain:
            # NOTE: all contexts end at the same position (single-stream decode): cut the gathered blocks to
            # it and attend without a mask (no mask to build or read; SDPA takes its unmasked path).
            length = md.decode_common_len
            out = F.scaled_dot_product_attention(
                query.to(cdt).unsqueeze(2),
                k[:, :length].transpose(1, 2),
                v[:, :length].transpose(1, 2),
                scale=self.scale,
                enable_gqa=True,
            )
            return out.reshape(num_decodes, self.num_heads, self.head_size)
        valid = md.decode_valid
        if self.sliding_window is not None:
            # The query sits at position seq_len - 1; it sees the W positions ending there.
            valid = valid & (
                md.decode_key_positions[None, :] >= md.decode_seq_lens[:, None] - self.sliding_window
            )
        if self.chunk_size is not None:
            # The query at position seq_len - 1 sees its own chunk only: from that chunk's first position on.
            chunk_start = (md.decode_seq_lens - 1) // self.chunk_size * self.chunk_size
            valid = valid & (md.decode_key_positions[None, :] >= chunk_start[:, None])
        if plain:
            # NOTE: SDPA reads the gathered K/V through strides (no permute copies) and handles GQA itself:
            # ~2.4x faster on the CPU than the einsum form below, which soft-capping still needs.
            out = F.scaled_dot_product_attention(
                query.to(cdt).unsqueeze(2),  # [D, heads, 1, head]
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=valid[:, None, None, :],
                scale=self.scale,
                enable_gqa=True,
            )
            return out.reshape(num_decodes, self.num_heads, self.head_size)
        q = query.float().reshape(num_decodes, self.num_kv_heads, self.group, self.head_size)
        scores = torch.einsum("dkgh,dlkh->dkgl", q, k) * self.scale
        if self.soft_cap is not None:
            scores = self.soft_cap * torch.tanh(scores / self.soft_cap)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        # Query head h = kv head * group + g: the sinks line up with the [kv heads, group] axes.
        probs = self._softmax(scores, None if self.sinks is None else self.sinks.view(self.num_kv_heads, self.group, 1))
        out = torch.einsum("dkgl,dlkh->dkgh", probs, v)
        return out.reshape(num_decodes, self.num_heads, self.head_size)

    def _prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, seg: PrefillSegment) -> torch.Tensor:
        # NOTE: float32 even for a bf16 model on the CPU: SDPA's CPU flash kernel (the prefill's path) ran 2x
        # slower in bf16 than in float32 with K/V repeated per head on an AVX512-BF16 EPYC without AMX (one
        # thread, SmolLM2's 9 x 64 heads, 128 tokens: 2.2 against 1.1 ms; level at 32). Not yet measured on AMX.
        q = query.float().transpose(0, 1)  # [heads, n, head]
        k, v = _gather_context(kv_cache, seg.blocks, self.k_scale, self.v_scale)
        # Drop the unused tail of the last block. GQA: each KV head serves `group` consecutive query heads.
        k = k[: seg.context_len].repeat_interleave(self.group, dim=1).transpose(0, 1)  # [heads, ctx, head]
        v = v[: seg.context_len].repeat_interleave(self.group, dim=1).transpose(0, 1)
        mask = self._prefill_mask(seg)
        if self.soft_cap is None and self.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            # SDPA has neither soft-cap nor sinks: spell the attention out.
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            if self.soft_cap is not None:
                scores = self.soft_cap * torch.tanh(scores / self.soft_cap)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = self._softmax(scores, None if self.sinks is None else self.sinks.view(self.num_heads, 1, 1))
            out = torch.matmul(probs, v)
        return out.transpose(0, 1)  # [n, heads, head]

    def _prefill_mask(self, seg: PrefillSegment) -> torch.Tensor:
        """[query_len, context_len] bool, True = may attend: causal, then the window or the chunk."""
        mask = seg.causal_mask
        if self.sliding_window is not None:
            mask = mask & (seg.key_positions[None, :] > seg.query_positions[:, None] - self.sliding_window)
        if self.chunk_size is not None:
            chunk = self.chunk_size
            mask = mask & (seg.key_positions[None, :] // chunk == seg.query_positions[:, None] // chunk)
        return mask

    @staticmethod
    def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax over the last axis; with sinks (broadcast to scores[..., :1]) over [scores | sink], the
        sink's column dropped (the module docstring)."""
        if sinks is None:
            return torch.softmax(scores, dim=-1)
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


class TorchSDPABackend:
    """Reference backend: any device, any dtype torch supports, sliding window, chunked local, soft-cap and sinks
    included."""

    name: ClassVar[str] = "torch"
    supports_sinks: ClassVar[bool] = True  # AttentionLayerConfig.sinks (the module docstring)
    supports_chunked_local: ClassVar[bool] = True  # AttentionLayerConfig.attention_chunk_size

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """K and V stacked on a leading axis of 2, each in NHD block layout."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """Precompute, once per step, the context slots and masks every layer reuses."""
        block_size = common.block_size
        block_table = common.block_table
        device = block_table.device
        num_decodes = common.num_decodes
        # Host copies only: planning must not wait on the device.
        query_start = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        if query_start[num_decodes] != num_decodes:
            raise ValueError(f"the first {num_decodes} requests must be decodes with exactly one query token")
        md = TorchSDPAMetadata(common=common, num_decodes=num_decodes)

        if num_decodes:
            num_blocks = -(-max(seq_lens[:num_decodes]) // block_size)
            positions = torch.arange(num_blocks * block_size, device=device)
            lens = common.seq_lens[:num_decodes].to(device=device, dtype=torch.int64)
            blocks = block_table[:num_decodes, :num_blocks].long()
            used = positions[None, ::block_size] < lens[:, None]  # [D, num_blocks]: block holds context
            md.decode_blocks = torch.where(used, blocks, 0)  # table padding may be any id (or -1)
            md.decode_valid = positions[None, :] < lens[:, None]
            md.decode_seq_lens = lens
            md.decode_key_positions = positions
            if len(set(seq_lens[:num_decodes])) == 1:
                md.decode_common_len = seq_lens[0]
            if num_decodes == 1 and num_blocks > 0:
                ids = block_table[0, :num_blocks]
                if device.type == "cpu" and bool((ids[1:] - ids[:-1] == 1).all()):  # host tensor: no sync
                    md.decode_first_block = int(ids[0])

        for i in range(num_decodes, common.num_reqs):
            start, end, context_len = query_start[i], query_start[i + 1], seq_lens[i]
            if end == start:
                continue
            key_positions = torch.arange(context_len, device=device)
            query_positions = key_positions[context_len - (end - start) :]
            md.prefills.append(
                PrefillSegment(
                    query_start=start,
                    query_end=end,
                    context_len=context_len,
                    blocks=block_table[i, : -(-context_len // block_size)].long(),
                    causal_mask=key_positions[None, :] <= query_positions[:, None],
                    query_positions=query_positions,
                    key_positions=key_positions,
                )
            )
        return md

    @staticmethod
    def make_impl(layer: AttentionLayerConfig) -> TorchSDPAImpl:
        """One impl per attention layer."""
        return TorchSDPAImpl(layer)
