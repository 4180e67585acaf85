"""Launch configurations of the unified attention kernel (triton/kernels.py) and the rule that picks one.

The table is the only place the defaults live: examples/gpu/prefill_sweep.py measures every entry and its
neighbours on the H200, and a new default is a one-line edit here.

Rule (`choose_config`), from host integers only (CUDA-graph safe: a captured decode or uniform-spec step has
fixed counts): the average number of new tokens per request, T / B.

    split-KV                 -> DECODE   rows = BLOCK_Q x G with BLOCK_Q small; memory-bound, the split policy
                                         (triton/backend.py NOTE 1) fills the GPU
    T / B <= 4               -> DECODE_WIDE  the same rows, 64-key tiles, 2 stages, heads first (NOTES 6, 8;
                                         DECODE_BIG: NOTE 7)
    4 < T / B < 128          -> MIXED    64 rows: prefill chunks next to many decodes, whose one-token blocks
                                         would waste most of a taller tile
    T / B >= 128             -> PREFILL  128 rows (32 tokens x 4 heads at G = 4), 8 warps, deep pipeline

NOTE 1 (why 128 rows need 8 warps and 5 stages). With 64 rows each K/V tile (64 keys: 32 KB) feeds 2 MFLOP,
so at 350 TFLOP/s the 132 SMs pull ~5.5 TB/s of K/V from L2 -- about what the H200's L2 delivers, which is
where the 64-row kernel levelled off (319 TFLOP/s). 128 rows halve that. But a 128-row program holds a
128 x 128 fp32 accumulator (64 registers a thread at 8 warps; 4 warps would spill) and runs at ~190
registers, so one program per SM: nothing else hides its loads. Triton's pipeliner gives a load behind one
level of indirection (K/V addresses come from the block table) a prefetch distance of (num_stages - 1) // 2
tiles, so stages 2, 3 and 4 all prefetch ONE tile and wait for it at the top of the next iteration (checked
in the sm_90 TTGIR: double buffers, async_wait 0); 5 stages prefetch two (triple buffers, 132 KB of shared
memory at tile 64), 7 three. The earlier sweep (rows 128 at 2-3 stages) never had a deeper pipeline.

NOTE 2 (reverse order). Blocks are dispatched in launch order, a request's query blocks by increasing
position: under the causal mask the last blocks of a request carry the most keys. REVERSE launches them
first, so the programs still running at the end of the grid are the shortest ones (longest-first
scheduling), not a last wave of 2048-key blocks.

NOTE 3 (K as rows). Loading K as [tile, head] rows puts K and V in one register layout, so the block-table
lookup and the per-key offsets are computed once per tile instead of once per layout (the sm_90 TTGIR of
the transposed gather loads the block ids twice); tl.trans is then a transposed shared-memory view that
wgmma reads directly (no register shuffle), as in Triton's own attention tutorial.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionConfig:
    """One launch configuration of _unified_attention_kernel."""

    rows: int  # BLOCK_M: query rows per program (tokens x G heads with pack_gqa; raised to the next pow2 of G)
    tile_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int  # Triton's pipeline depth (NOTE 1: K/V prefetch distance is (num_stages - 1) // 2)
    reverse: bool = False  # launch each request's last (heaviest causal) query blocks first (NOTE 2)
    k_rows: bool = False  # load K as [tile_n, head] rows and transpose in the dot, instead of a [head, tile_n] gather
    pack_gqa: bool = True  # rows = tokens x the G heads of a KV head; False: one query head's tokens per program
    heads_first: bool = False  # launch order: a request's KV heads one after another (triton_kernels' docstring)


DECODE = AttentionConfig(rows=16, tile_n=32, num_warps=4, num_stages=3)
# NOTE 6 (measured, H200, examples/gpu/decode_sweep.py, 2026-11-30 03:10 UTC, bf16, 32/8 heads, head 128, graph
# replays): with one segment per request, 64-key tiles double-buffered beat DECODE on every decode batch tried:
#   64 x 2048 125.9 vs 141.9 us (4.26 vs 3.78 TB/s of K/V), W2's 500 x U[128, 1152] 319.7 vs 382.7 us (4.05 vs
#   3.38), W5's 288 x U[100, 2048] 307.9 vs 375.4 (3.95 vs 3.24), 512 x U[100, 2048] 536.1 vs 631.0 (4.15 vs
#   3.53); best of 96 configs (segments 1-8, tiles 16-64, 2-8 warps, 2-4 stages) in all four. Twice the keys per
#   iteration halves the loop's fixed work (block-table lookups, the online-softmax rescale) per byte, and two
#   stages leave room for three programs per SM. Split-KV steps (small batches, W3) keep DECODE: not swept there.
# NOTE 8 (measured, H200, `decode_sweep.py --quick --decode-only --heads-first`, 2026-11-30 13:51 UTC, one
# process): the heads-first launch order (a request's 8 KV heads one after another) against the default order,
# same config: at 64-key tiles W2's 500 x U[128, 1152] 313.4 vs 320.1 us (-2.1 %), W2 lockstep 500 x 640 -1.5 %,
# 500 x 1100 -1.1 %, W5's 288 / 512 x U[100, 2048] -1.4 / -1.3 %, 64 x 2048 +0.4 % (126.1 vs 125.6 us, noise);
# at 128-key tiles (DECODE_BIG) -1.3 to -2.4 %. Every fast config gained: the programs running at once read
# whole 2 KB token rows of fewer pages. Both decode entries launch heads first (split-KV DECODE: not swept).
DECODE_WIDE = AttentionConfig(rows=16, tile_n=64, num_warps=4, num_stages=2, heads_first=True)
# NOTE 7 (measured, H200, `examples/gpu/decode_sweep.py --quick --decode-only`, 2026-11-30 08:37 UTC, bf16, same
# shapes as NOTE 6): 128-key tiles, 4 warps, 3 stages against DECODE_WIDE: W2's 500 x U[128, 1152] 317.0 vs 323.2 us
# (4.16 vs 4.08 TB/s), W5's 288 x U[100, 2048] 293.3 vs 306.4, 512 x U[100, 2048] 519.6 vs 538.2 -- but 64 x 2048
# 131.0 vs 126.3 (the same-length batch keeps the 64-key tile). Half the loop iterations per request: the
# fixed work per tile (block-table lookups, the softmax rescale) matters most where many requests' contexts end
# mid-tile. 74 KB of shared memory (offline sm_90 compile), three programs per SM; a cascade launch with it
# rounds its shared prefix to 128 keys (triton_kernels' ALIGN). Through the engine on another machine (08:43
# UTC) W2 and W5 lost against an earlier machine -- inside the machine spread, so the rule waited for an A/B on
# one machine. Heads first (NOTE 8), 13:51 UTC: W2 lockstep 500 x 640 310.0 vs DECODE_WIDE's 318.9 us (-2.8 %),
# 500 x 1100 507.4 vs 522.0, W5 288 x U[100, 2048] 286.5 vs 302.3 (-5.2 %), 64 x 2048 141.9 vs 126.0 (+13 %:
# small same-length batches keep 64-key tiles). Through the engine, one machine, 13:58-14:05 UTC (`bench_suite.py
# --workloads W2,W5`, old order A / DECODE_BIG from 256 requests + heads first B, A B A B): W2 22,554 / 22,744 /
# 22,604 / 22,781 total tok/s (+0.8 %), W5 24,894 / 25,262 / 24,982 / 25,275 (+1.3 %); A/A and B/B within
# 0.35 %. The backend takes it for decode-only steps of `plugins.triton.decode_big_min_seqs` (256) requests.
DECODE_BIG = AttentionConfig(rows=16, tile_n=128, num_warps=4, num_stages=3, heads_first=True)
# NOTE 4 (measured, H200, examples/gpu/prefill_sweep.py, 2026-11-29 22:07 UTC, bf16, 32/8 heads, head 128):
#   8 x 2048 causal: rows 64 tile 64 4 warps 2 stages K-as-rows 332.7 TFLOP/s, best of 40 configs (the
#   128-row, 5-stage entry predicted by NOTE 1: 320.0; the v1 default 320.9); 1 x 8192: the same entry 385.1,
#   rows 128 tile 128 8 warps 5 stages reverse 420.2 (a single long request is where 128 rows pay).
#   Mixed (4 x 2048 prefill + 256 decodes at 2048 context): rows 64 tile 32 4 warps 5 stages reverse +
#   K-as-rows 161.9 against 140.2 for the earlier MIXED entry.
MIXED = AttentionConfig(rows=64, tile_n=32, num_warps=4, num_stages=5, reverse=True, k_rows=True)
PREFILL = AttentionConfig(rows=64, tile_n=64, num_warps=4, num_stages=2, k_rows=True)

MIXED_MIN_TOKENS_PER_REQ = 4  # above: MIXED (the v1 kernel's "prefill-heavy" rule)
PREFILL_MIN_TOKENS_PER_REQ = 128  # at or above: PREFILL


@dataclass(frozen=True)
class FreshPrefillConfig:
    """One launch configuration of triton_prefill._fresh_prefill_kernel (fresh prefills, K/V from the step's
    own contiguous key/value rows: NOTE 5)."""

    rows: int  # BLOCK_M: query rows per program (tokens x G heads with pack_gqa)
    tile_n: int  # keys per inner-loop step (one TMA box of [tile_n, head])
    num_warps: int
    num_stages: int
    kv_load: str = "host"  # "host" / "device" TMA descriptors, or "pointer" loads (triton_prefill docstring)
    # Triton's automatic warp specialization of the key loop: 4 warps, one head per program, descriptors made
    # on the device (triton_prefill's WARP_SPEC NOTE says why); ignored with pointer loads.
    warp_specialize: bool = False
    pack_gqa: bool = True  # rows = tokens x the G heads of a KV head; False: one query head's tokens


# NOTE 5 (fresh prefills). A request with nothing cached before the step (seq_len == query_len) reads its keys
# from the step's key/value tensors, not the pages: contiguous rows, so TMA boxes and Triton's Hopper pipeline
# with no block-table indirection: the prefetch distance is num_stages - 1 (3 stages: triple K/V buffers, 129 KB
# with Q), not NOTE 1's (num_stages - 1) // 2. The first default was 128 rows (32 tokens x 4 heads), tile 64,
# 8 warps, 3 stages, host descriptors (182 registers, no spills, Triton 3.6, sm_90a, offline); the sweep below
# picked 64 rows / 4 warps. The warp-specialized variant (4 warps become a TMA producer + two 64-row consumer
# warpgroups, 12 warps, 168 registers, 144 KB) compiles too.
# Measured (H200, examples/gpu/prefill_sweep.py, 2026-11-30 00:33 UTC, bf16, 32/8 heads, head 128, 16 F rows):
#   8 x 2048 causal: rows 64 tile 64 4 warps 3 stages host descriptors 452.0 TFLOP/s (the 128-row entry
#   430.5; the paged kernel's best 333.5); 1 x 8192: 544.5 (best: rows 128 tile 128 8 warps, 568.0). Through
#   TritonImpl.forward (cache write + route) 406.9 on 8 x 2048. The warp-specialized rows were correct at
#   tile 128 / 2 stages (422.1) but gave NaN at tile 64 / 3-4 stages with device descriptors on Triton 3.6:
#   warp specialization stays off.
FRESH_PREFILL = FreshPrefillConfig(rows=64, tile_n=64, num_warps=4, num_stages=3)
# The backend routes a run of fresh requests to the fresh kernel when its longest has this many new tokens
# (triton/backend.py NOTE 4; also the bound below which uniform steps may be graph-captured).
FRESH_MIN_QUERY_LEN = 64


def choose_config(num_tokens: int, num_seqs: int, num_segments: int) -> AttentionConfig:
    """The table entry for a batch of `num_tokens` new tokens over `num_seqs` requests (module docstring)."""
    if num_segments > 1:
        return DECODE
    if num_tokens <= num_seqs * MIXED_MIN_TOKENS_PER_REQ:
        return DECODE_WIDE
    if num_tokens >= num_seqs * PREFILL_MIN_TOKENS_PER_REQ:
        return PREFILL
    return MIXED
