"""Token-expert pairs sorted by expert and padded to BLOCK_M rows per expert: the schedule the fused-MoE grouped
GEMMs (fused_moe_triton.py) walk, built on the device in two Triton launches (vLLM's moe_align_block_size).

    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids [T, K] int32, block_m, num_experts)

The accounting, for T=3 tokens, K=2, E=3, BLOCK_M=4 (a pair's flat index is t * K + k):

    topk_ids  [[2, 0], [2, 2], [0, 1]]      flat: 0:e2 1:e0 2:e2 3:e2 4:e0 5:e1     numel = T * K = 6
    counts    e0: 2   e1: 1   e2: 3         padded to BLOCK_M: 4, 4, 4 -> total = 12
    slots     | 1  4  P  P | 5  P  P  P | 0  2  3  P | P ...  (P = numel, the padding sentinel)
              +-- e0 ------+-- e1 ------+-- e2 ------+-- beyond total: never read
    expert_ids [0, 1, 2, -1 ...]            one per BLOCK_M slots

    sorted_ids  int32 [EM], EM = min(numel * BLOCK_M, numel + E * (BLOCK_M - 1)): the most slots any routing
                can need (each non-empty expert pads at most BLOCK_M - 1 rows; at most numel experts are
                non-empty), so the buffers have a size known on the host and no step waits for the device
    expert_ids  int32 [cdiv(EM, BLOCK_M)], -1 for blocks at or past `total`
    total       int32 [1], the padded row count: blocks starting at or past it have nothing to do

Within an expert the pairs keep their flat order (a stable sort), so the schedule is the same every run.

NOTE 1 (two launches, no host sync): launch 1 counts each chunk's ids per expert ([chunks, E] histograms);
launch 2 has every program sum all histograms (a few KB) for the experts' starts, add the chunks before its
own for its cursors, and place its chunk's pairs -- the rank of a pair among the same expert's pairs of the
chunk is a cumulative sum over a [chunk, E] one-hot. The same programs write the padding sentinels and the
block experts for a slice of the slots each. No atomics (the interpreter runs it as the GPU does), nothing to
zero first, nothing read back on the host: the whole MoE layer stays inside a CUDA graph.

NOTE 2 (invalid ids): an id outside [0, E) belongs to no expert and gets no slot; fused_moe rejects such ids
on the host where that costs nothing (CPU tensors) and relies on its router on CUDA (a check there would be a
device-to-host sync per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch

MAX_EXPERTS = 1024  # the one-hot tiles below are [chunk, next_power_of_2(E)]
_ONE_HOT_ELEMENTS = 8192  # chunk * E_PAD per tile: 64 int32 per thread at 4 warps, no spills


@triton.jit(do_not_specialize=["numel"])  # fused_moe_triton NOTE 4: sizes that change per batch
def _count_kernel(ids_ptr, hist_ptr, numel, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """hist[chunk, e] = how many of the chunk's pairs go to expert e."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    e = tl.arange(0, E_PAD)
    hot = (ids[:, None] == e[None, :]) & (e < num_experts)[None, :]  # NOTE 2: ids past E match no lane
    tl.store(hist_ptr + c * E_PAD + e, tl.sum(hot.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["numel", "num_chunks", "em", "slots_per_program"])
def _place_kernel(
    ids_ptr, hist_ptr, sorted_ptr, expert_ids_ptr, total_ptr,
    numel, num_experts, num_chunks, em, slots_per_program,
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    c = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    # Every chunk's counts (for the experts' starts) and the earlier chunks' (for this chunk's cursors).
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for q0 in range(0, num_chunks, CHUNK):
        q = q0 + tl.arange(0, CHUNK)
        h = tl.load(hist_ptr + q[:, None] * E_PAD + e[None, :], mask=(q < num_chunks)[:, None], other=0)
        counts += tl.sum(h, axis=0)
        before += tl.sum(tl.where((q < c)[:, None], h, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if c == 0:
        tl.store(total_ptr, total)

    # This chunk's pairs: slot = expert start + earlier chunks' pairs of that expert + rank in this chunk.
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    # All zero for padding lanes and for ids outside [0, E) (NOTE 2).
    hot = ((ids[:, None] == e[None, :]) & (e < num_experts)[None, :]).to(tl.int32)
    rank = tl.sum((tl.cumsum(hot, axis=0) - hot) * hot, axis=1)
    base = tl.sum(hot * (starts + before)[None, :], axis=1)
    tl.store(sorted_ptr + base + rank, offs, mask=tl.sum(hot, axis=1) > 0)

    # This program's slice of the slots: padding sentinels, and the expert of each block that starts here.
    for s0 in range(c * slots_per_program, tl.minimum((c + 1) * slots_per_program, em), CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        # The expert whose [start, end) holds s: how many experts end at or before s (E_PAD past total).
        owner = tl.sum((ends[None, :] <= s[:, None]).to(tl.int32), axis=1)
        own = owner[:, None] == e[None, :]
        offset = s - tl.sum(tl.where(own, starts[None, :], 0), axis=1)
        is_pair = (s < total) & (offset < tl.sum(tl.where(own, counts[None, :], 0), axis=1))
        tl.store(sorted_ptr + s, numel, mask=(s < em) & ~is_pair)
        tl.store(expert_ids_ptr + s // BLOCK_M, tl.where(s < total, owner, -1), mask=(s < em) & (s % BLOCK_M == 0))


def max_slots(numel: int, block_m: int, num_experts: int) -> int:
    """EM: the slots the worst routing of `numel` pairs over `num_experts` experts can need (module doc)."""
    return min(numel * block_m, numel + num_experts * (block_m - 1))


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [EM], expert_ids [cdiv(EM, block_m)], total [1]) for topk_ids [T, K] int32 (module doc)."""
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"moe_align_block_size: topk_ids must be int32, got {topk_ids.dtype}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"moe_align_block_size: num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    numel = ids.numel()
    em = max_slots(numel, block_m, num_experts)
    device = ids.device
    sorted_ids = torch.empty(em, dtype=torch.int32, device=device)
    expert_ids = torch.empty(triton.cdiv(em, block_m), dtype=torch.int32, device=device)
    total = torch.zeros(1, dtype=torch.int32, device=device)
    if numel == 0:
        return sorted_ids, expert_ids, total
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(1024, _ONE_HOT_ELEMENTS // e_pad))
    chunks = triton.cdiv(numel, chunk)
    hist = torch.empty(chunks, e_pad, dtype=torch.int32, device=device)
    launch(_count_kernel, (chunks,), ids, hist, numel, num_experts, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    launch(
        _place_kernel, (chunks,),
        ids, hist, sorted_ids, expert_ids, total,
        numel, num_experts, chunks, em, triton.cdiv(em, chunks),
        E_PAD=e_pad, CHUNK=chunk, BLOCK_M=block_m, num_warps=4,
    )
    return sorted_ids, expert_ids, total
