"""The `triton` attention backend: the torch backend's cache layout, written and read by Triton kernels.

Per step `build_metadata` only decides the split-KV plan; everything else the kernels need is already in
the common metadata (query_start_loc, seq_lens, block_table, slot_mapping), on the device. Nothing here
reads a device tensor back to the host, so a decode step can be captured in a CUDA graph.

Split-KV policy (NOTE 1): a decode-only batch of B requests over H_kv KV heads runs B * H_kv programs; when
that leaves SMs idle, each context is cut into S segments (S a power of two, at most 32) and merged by a
second small kernel. The choice depends only on B and H_kv -- never on context lengths -- so a graph
captured for a padded batch size stays valid for every later step of that size. Prefill-carrying batches
have enough query blocks and never split.

NOTE 2 (the fill target, 2 programs per SM): splitting is not free -- every segment writes a float32
partial row that the merge kernel reads back, and each shorter program spends a larger share of its time
starting its pipeline. The H200 sweep (docs/perf-notes.md 1b) measured 64 x 2048 unsplit (512 programs,
3.9 per SM) at 3.78 TB/s against 3.12 TB/s with the earlier target of 8 per SM (4 segments): a 4-warp
program streaming 32-key tiles keeps enough bytes in flight that ~2 per SM already saturate HBM. So split
only below 2 per SM. Single-request and small-batch decode (8-64 programs) still get 8-32 segments, where
one program per (request, head) leaves most SMs idle: one request over 32k keys ran 0.10 TB/s unsplit,
1.38 at 16 segments and 2.24 at 32 (hence the cap of 32). The graph-timed sweep over batch 1..128 is in
docs/perf-notes.md 2.

NOTE 3 (cascade attention, as vLLM's FlashAttention backend does it for shared prefixes): when many decoding
requests share their first P tokens' blocks (one system prompt, W4's 1024-token prefix), each request re-reads
those keys. The runner's step buffers carry [P, s, flags] on the device (CommonAttentionMetadata.cascade),
recomputed every step on the host from the block table; the prefix kernel reads the shared keys once per 64
query rows (16 requests x 4 heads, on tensor cores) for the flagged requests, the per-request kernel starts
after them, and the segment reduction merges both. W4 on the H200: decode steps of ~496 requests 31.3 -> 23.5
ms of GPU, 1.17x end to end (docs/perf-notes.md 7). P = 0 makes the same captured graph a plain step (direct
output, the merge returns at once). Not used with a sliding window (a window's first key moves).

NOTE 4 (fresh prefills, triton/prefill.py). A request with nothing cached before the step (seq_lens[i] equal
to its query length: a prompt without a prefix hit, or a chunked prompt's first chunk) has all its keys in the
step's own key/value tensors, which the fresh-prefill kernel reads as contiguous rows through TMA instead of
gathering pages. build_metadata finds, from the host copies, the run of such requests that ends the batch
(the scheduler lists running requests -- decodes, later chunks -- before newly admitted ones, so a step's
fresh prompts are its last requests), taken when its longest has `plugins.triton.fresh_prefill_min_tokens`
(default 1024; never under FRESH_MIN_QUERY_LEN) tokens. On the H200 the route cost 2-3 % on W1 / W5's
1024-token prompts while the decodes beside them ran at the slow DECODE entry; with DECODE_WIDE it gains 0.9 %
on W1 (perf-notes §18a), and its kernel is 1.3-1.4x at 2048-8192 tokens. The unified kernel
takes the requests before the run (its grid is sized by their tokens, so it never looks at the run's rows),
the fresh kernel the run. Both write disjoint rows of one output; reshape_and_cache still fills the pages
for later steps. Never in a captured graph: graph steps are decodes or uniform q-token steps with
q <= cuda_graph_max_query_len < FRESH_MIN_QUERY_LEN (so the capture's dummy step, fresh by construction,
is not routed). Not with an fp8 cache (the kernel would attend to the
unrounded K/V, unlike the unified kernel's), with a head the kernel lacks (not a power of two), or when the
config's `plugins.triton.fresh_prefill` is false.

NOTE 5 (decodes in their own launch, `plugins.triton.split_decodes_min`). One launch of the unified kernel
takes one launch configuration for the whole step, chosen by tokens per request: a W1 step (~480 decodes
beside 16 fresh 1024-token prompts, 34 tokens per request) gets MIXED, whose programs hold 64 query rows --
16 tokens x 4 heads -- so a decode's program computes its scores 16x over on the tensor cores for the 4 rows it
keeps. Split, the decodes (the batch's first requests) run as their own launch, picked by the same rule as a
decode-only step (DECODE_WIDE, 16 rows), and the rest as a second launch over views of the step's tensors from
the first non-decode request on, with query_start_loc rebased to 0 (one small device op per step, cached in
the metadata) -- the kernel itself is unchanged. What one launch had and two lose: decode programs (memory-
bound) and prompt programs (compute-bound) sharing the SMs. Measured on the H200 (perf-notes §18a): a W1
wave's attention 1.064 ms a layer split against 1.046 in one launch (prefill_sweep.py's w1wave case), W1 3.3 %
slower end to end -- so off by default; the fresh route (NOTE 4) is what a W1 wave takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention.triton import TritonOptions
from pagedllm.plugins.attention.triton.tuning import FRESH_MIN_QUERY_LEN

# Programs we want in flight for one decode launch, per SM (NOTES 1, 2); measured by h200_check.py stage b.
_PROGRAMS_PER_SM = 2
_MAX_SEGMENTS = 32


@dataclass
class TritonMetadata:
    """The common metadata plus the split-KV decision for the step."""

    common: CommonAttentionMetadata
    decode_only: bool = False
    num_sms: int = 132
    # Force a split factor (benchmarks); None = the NOTE 1 policy per layer.
    num_segments: int | None = None
    # NOTE 4: requests fresh_from .. num_reqs - 1 go to the fresh-prefill kernel (None: no request does).
    fresh_from: int | None = None
    # Device block plans of the fresh run, per rows-per-block (built by the first layer, shared by the rest).
    fresh_plans: dict[int, torch.Tensor] = field(default_factory=dict)
    # NOTE 5: the leading decodes run as their own launch (None: one launch for the step).
    split_decodes: int | None = None
    _rest_qsl: torch.Tensor | None = None

    def rest_query_start_loc(self) -> torch.Tensor:
        """query_start_loc of the requests after the split decodes, rebased to start at 0 (NOTE 5); built by
        the first layer, shared by the rest."""
        if self._rest_qsl is None:
            assert self.split_decodes is not None
            qsl = self.common.query_start_loc
            self._rest_qsl = qsl[self.split_decodes :] - qsl[self.split_decodes]
        return self._rest_qsl

    def fresh_plan(self, block_q: int) -> torch.Tensor:
        """The fresh run's block plan for `block_q` query tokens per block (triton_prefill.plan_blocks)."""
        plan = self.fresh_plans.get(block_q)
        if plan is None:
            assert self.fresh_from is not None
            from pagedllm.plugins.attention.triton.prefill import plan_blocks

            common = self.common
            starts = common.query_start_loc_cpu[self.fresh_from : common.num_reqs + 1].numpy()
            plan = torch.from_numpy(plan_blocks(starts, block_q)).to(common.seq_lens.device, non_blocking=True)
            self.fresh_plans[block_q] = plan
        return plan


def fresh_run_start(common: CommonAttentionMetadata, min_tokens: int = FRESH_MIN_QUERY_LEN) -> int | None:
    """First request of the run of fresh prefills (nothing cached before the step) that ends the batch, if the
    run's longest request has >= min_tokens (never below FRESH_MIN_QUERY_LEN) new tokens; else None (NOTE 4).
    Host copies only."""
    n = common.num_reqs
    min_tokens = max(min_tokens, FRESH_MIN_QUERY_LEN)
    if n == 0 or common.num_decodes == n or common.max_query_len < min_tokens:
        return None
    lens = np.diff(common.query_start_loc_cpu[: n + 1].numpy())
    stale = np.flatnonzero(common.seq_lens_cpu[:n].numpy() != lens)
    start = int(stale[-1]) + 1 if stale.size else 0
    if start == n or int(lens[start:].max()) < min_tokens:
        return None
    return start


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs: small, so tests exercise both paths
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_segments(num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Split factor for a decode-only batch: enough programs to fill the GPU, a power of two, <= 32."""
    programs = max(1, num_reqs * num_kv_heads)
    want = -(-num_sms * _PROGRAMS_PER_SM // programs)
    segments = 1
    while segments < want and segments < _MAX_SEGMENTS:
        segments *= 2
    return segments


def choose_prefix_segments(rows: int, num_kv_heads: int, num_sms: int) -> int:
    """Split factor of a cascade's shared prefix: (rows / 64 tiles) x KV heads x segments >= 2 per SM, <= 16."""
    programs = max(1, -(-rows // 64) * num_kv_heads)
    want = -(-num_sms * _PROGRAMS_PER_SM // programs)
    segments = 1
    while segments < want and segments < 16:
        segments *= 2
    return segments


class TritonImpl:
    """One layer: reshape_and_cache, then the unified kernel (split-KV when the metadata asks)."""

    def __init__(self, layer: AttentionLayerConfig, options: TritonOptions | None = None) -> None:
        self.options = options or TritonOptions()
        self.num_heads = layer.num_heads
        self.num_kv_heads = layer.num_kv_heads
        self.head_size = layer.head_size
        self.scale = layer.scale
        self.sliding_window = layer.sliding_window
        self.soft_cap = layer.logits_soft_cap
        # Per-tensor scales of an fp8 KV cache (unused otherwise): stored value = x / scale. 1.0 is vLLM's
        # default when a checkpoint ships no k_scale/v_scale; e4m3 holds |x| <= 448, ample for K and V of
        # the models here. A loader that reads checkpoint scales sets these attributes.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
    ) -> torch.Tensor:
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        from pagedllm.api.kernels import reshape_and_cache

        common = metadata.common
        num_tokens = common.num_actual_tokens
        reshape_and_cache(
            key[:num_tokens], value[:num_tokens], kv_cache, common.slot_mapping, self.k_scale, self.v_scale
        )
        # Rows past num_actual_tokens (padding) are zero, as the torch backend leaves them.
        out = torch.zeros_like(query) if query.shape[0] > num_tokens else torch.empty_like(query)
        query = query.contiguous() if query.stride(-1) != 1 else query
        num_seqs = common.num_reqs
        fresh_from = metadata.fresh_from
        if fresh_from is not None and self._fresh_ok(query, key, value, kv_cache):  # NOTE 4: the run, the rest
            self._fresh(query, key, value, out, metadata)
            num_seqs = fresh_from
            num_tokens = int(common.query_start_loc_cpu[num_seqs])
            if num_seqs == 0:
                return out
        split = metadata.split_decodes
        if split is not None and split < num_seqs:  # NOTE 5: the decodes, then the rest over views of the step
            self._unified(query, kv_cache, out, common.query_start_loc, common.seq_lens, common.block_table,
                          split, split, 1)
            self._unified(query[split:], kv_cache, out[split:], metadata.rest_query_start_loc(),
                          common.seq_lens[split:], common.block_table[split:], num_seqs - split,
                          num_tokens - split, 1)
            return out
        segments = self._segments(metadata)
        self._unified(query, kv_cache, out, common.query_start_loc, common.seq_lens, common.block_table, num_seqs,
                      num_tokens, segments, **self._cascade(metadata))
        return out

    def _unified(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor, block_table: torch.Tensor, num_seqs: int, num_tokens: int, segments: int,
        **cascade: Any,
    ) -> None:
        from pagedllm.plugins.attention.triton.kernels import unified_attention

        unified_attention(
            query, kv_cache, out, query_start_loc, seq_lens, block_table, num_seqs=num_seqs, num_tokens=num_tokens,
            scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap, num_segments=segments,
            k_scale=self.k_scale, v_scale=self.v_scale, config=_decode_config(num_tokens, num_seqs, segments, self.options),
            **cascade,
        )

    def _fresh_ok(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this layer sends a step's fresh run to the fresh-prefill kernel (NOTE 4)."""
        if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        from pagedllm.plugins.attention.triton.prefill import supports

        return supports(self.head_size, query.dtype) and key.stride(1) == value.stride(1) == self.head_size

    def _fresh(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, md: TritonMetadata
    ) -> None:
        from pagedllm.plugins.attention.triton.prefill import (
            default_config,
            fresh_prefill_attention,
            launch_shape,
        )

        config = default_config()
        block_q = launch_shape(config, self.num_heads // self.num_kv_heads)[1]
        fresh_prefill_attention(
            query, key, value, out, md.fresh_plan(block_q), md.common.num_actual_tokens, self.scale,
            sliding_window=self.sliding_window, soft_cap=self.soft_cap, config=config,
        )

    def _cascade(self, md: TritonMetadata) -> dict[str, Any]:
        """Cascade arguments for a decode-only step whose metadata carries the shared-prefix tensor (NOTE 3)."""
        cascade = md.common.cascade
        if cascade is None or not md.decode_only or self.sliding_window is not None:
            return {}
        group = self.num_heads // self.num_kv_heads
        return {"cascade": cascade,
                "prefix_segments": choose_prefix_segments(md.common.num_reqs * group, self.num_kv_heads, md.num_sms)}

    def _segments(self, md: TritonMetadata) -> int:
        if md.num_segments is not None:
            return md.num_segments
        if not md.decode_only:
            return 1
        return choose_segments(md.common.num_reqs, self.num_kv_heads, md.num_sms)


class TritonBackend:
    """Paged attention in Triton: fp32/fp16/bf16 (fp8 KV cache), GQA, sliding window, soft-cap, split-KV."""

    name: ClassVar[str] = "triton"
    # The engine's `plugins.triton` section, bound by `configure` (the class itself runs the defaults).
    options: ClassVar[TritonOptions] = TritonOptions()
    # The metadata holds only the common tensors and values fixed by the batch size: a decode step can be
    # captured in a CUDA graph and replayed with new contents in the same buffers.
    supports_cuda_graphs: ClassVar[bool] = True
    # Uniform multi-token graph steps (speculative verification) stay below the fresh-prefill route (NOTE 4).
    cuda_graph_max_query_len: ClassVar[int] = FRESH_MIN_QUERY_LEN - 1

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The torch backend's layout: K and V stacked on a leading axis of 2, each NHD blocks."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def configure(cls, options: TritonOptions) -> type[TritonBackend]:
        """This backend bound to one engine's `plugins.triton` section (AttentionBackend's optional member):
        a subclass per engine, so two engines in one process may run different options."""
        return type(cls.__name__, (cls,), {"options": TritonOptions.model_validate(options)})

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TritonMetadata:
        """Note whether the batch is decode-only (split-KV candidates) and where its run of fresh prefills
        starts (NOTE 4); no device reads."""
        decode_only = common.num_reqs > 0 and common.num_decodes == common.num_reqs
        options = cls.options
        fresh_from = fresh_run_start(common, options.fresh_prefill_min_tokens) if options.fresh_prefill else None
        threshold = options.split_decodes_min
        split = common.num_decodes if threshold and not decode_only and common.num_decodes >= threshold else None
        return TritonMetadata(common, decode_only, _num_sms(common.block_table.device), fresh_from=fresh_from,
                              split_decodes=split)

    @classmethod
    def make_impl(cls, layer: AttentionLayerConfig) -> TritonImpl:
        """One impl per attention layer, with this engine's options."""
        return TritonImpl(layer, cls.options)


def _decode_config(num_tokens: int, num_seqs: int, segments: int, options: TritonOptions) -> Any:
    """triton_tuning's entry for the step with the plugin's decode switches applied: DECODE_BIG for a
    decode-only, unsplit step of at least `plugins.triton.decode_big_min_seqs` requests (triton/tuning.py NOTE 7),
    the default launch order when `plugins.triton.decode_heads_first` is off (NOTE 8). Host integers only."""
    from pagedllm.plugins.attention.triton.tuning import DECODE_BIG, choose_config

    threshold = options.decode_big_min_seqs
    if threshold and segments == 1 and num_tokens == num_seqs >= threshold:
        config = DECODE_BIG
    else:
        config = choose_config(num_tokens, num_seqs, segments)
    return config if options.decode_heads_first or not config.heads_first else replace(config, heads_first=False)
