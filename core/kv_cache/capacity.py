"""What the KV pool holds: bytes per token per group, the context it fits, and the longest request it admits.

Accounting, for a pool of N blocks (block 0 is the null block, so N - 1 are usable) shared by groups g:

    blocks_g(L)  blocks one request of L tokens holds in group g at once (spec.max_blocks_per_request):
                 full attention  cdiv(L, bs_g)                              grows with the length
                 sliding window  min(cdiv(L, bs_g), cdiv(W - 1 + c, bs_g) + 1)  bounded; c = the step's
                                 chunk (max_num_batched_tokens): while decoding c = 1, so ceil(W / bs) + 1
    need(L)      sum over groups of blocks_g(L)
    max_model_len  the largest L <= the model's limit with need(L) <= N - 1: a request alone always fits
    requests(L)  (N - 1) // need(L): requests of L tokens the pool holds at once

Every block costs `bytes_per_block` (kv_cache/layout.py: one page in every shared tensor), so a token of
group g costs bytes_per_block / bs_g.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv_cache.layout import KVCacheLayout
from pagedllm.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCapacity:
    """The start-up capacity report of one KV cache (logged, and part of EngineParts.describe())."""

    layout: KVCacheLayout
    num_blocks: int
    max_chunk: int  # tokens a request computes in one step at most (the scheduler's token budget)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_per_request(self, num_tokens: int) -> int:
        """need(L): blocks, over all groups, one request of `num_tokens` tokens holds at once."""
        return sum(g.spec.max_blocks_per_request(num_tokens, self.max_chunk) for g in self.layout.groups)

    def requests_that_fit(self, num_tokens: int) -> int:
        """requests(L): how many requests of `num_tokens` tokens the pool holds at once."""
        return self.usable_blocks // max(1, self.blocks_per_request(num_tokens))

    def max_len(self, limit: int) -> int:
        """The largest L <= limit whose need(L) fits in the usable blocks (need is monotone: bisect)."""
        if self.blocks_per_request(limit) <= self.usable_blocks:
            return limit
        lo, hi = 0, limit  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.blocks_per_request(mid) <= self.usable_blocks:
                lo = mid
            else:
                hi = mid
        return lo

    def context_tokens(self) -> int | None:
        """Tokens of growing (full-attention) context the pool holds, summed over requests, or None when no
        group grows with the length (then only the number of requests is bounded)."""
        growing = [g for g in self.layout.groups if not _bounded(g.spec)]
        if not growing:
            return None
        # Each token of context takes a slot in every growing group; blocks of bounded groups not counted.
        return self.usable_blocks // len(growing) * min(g.spec.block_size for g in growing)

    def describe(self, max_model_len: int) -> str:
        """The report: the pool, each group, and what fits."""
        layout = self.layout
        bpb = layout.bytes_per_block
        pad = layout.padding_slots()
        lines = [
            f"kv cache: {self.num_blocks} blocks x {bpb:,} bytes = "
            f"{self.num_blocks * bpb / (1 << 30):.2f} GiB; "
            f"{len(layout.groups)} group(s) sharing {len(layout.slot_specs)} layer tensor(s)"
            + (f" ({pad} padded layer slot(s))" if pad else "")
        ]
        for gid, group in enumerate(layout.groups):
            spec = group.spec
            per_token = bpb / spec.block_size
            if isinstance(spec, SlidingWindowSpec):
                decode_bound = spec.max_blocks_per_request(1 << 62, 1)
                bound = (
                    f"window {spec.sliding_window}: <= ceil({spec.sliding_window}/{spec.block_size})+1 = "
                    f"{decode_bound} blocks per request while decoding "
                    f"({decode_bound * bpb / (1 << 20):.1f} MiB), whatever the length"
                )
            elif isinstance(spec, MambaSpec):
                bound = (
                    f"constant state: 1 block ({spec.page_size_bytes:,} bytes per layer) per request, "
                    "whatever the length"
                )
            elif isinstance(spec, FullAttentionSpec):
                bound = "grows with the length"
            else:
                bound = f"<= {spec.max_blocks_per_request(max_model_len, self.max_chunk)} blocks per request"
            lines.append(
                f"  group {gid}: {type(spec).__name__}, {len(group.layer_indices)} layers, "
                f"block {spec.block_size}"
                f" tokens, {per_token:,.0f} bytes/token; {bound}"
            )
        tokens = self.context_tokens()
        holds = f"{tokens:,} tokens of full-attention context" if tokens is not None else "no growing context"
        decoding = KVCapacity(layout, self.num_blocks, max_chunk=1)
        lines.append(
            f"  holds {holds}; max_model_len {max_model_len:,}: one such request needs "
            f"{decoding.blocks_per_request(max_model_len)} blocks decoding "
            f"({self.blocks_per_request(max_model_len)} while prefilling {self.max_chunk:,}-token chunks); "
            f"{decoding.requests_that_fit(max_model_len)} of them decode at once"
        )
        return "\n".join(lines)


def _bounded(spec: KVCacheSpec) -> bool:
    """Whether a group's blocks per request stop growing with the length (sliding window, constant state)."""
    huge = 1 << 40
    return spec.max_blocks_per_request(huge, 1) < -(-huge // spec.block_size)
