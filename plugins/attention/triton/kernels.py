"""Triton kernels of the `triton` backend: one unified paged-attention kernel (new K/V rows are written by pagedllm.api.kernels.reshape_and_cache).

Cache layout (the torch backend's): kv_cache [2, num_blocks, block_size, kv_heads, head], K = [0], V = [1].

Unified kernel, one program per (query block, KV head [, KV segment]):

    request i owns flat query rows qsl[i] .. qsl[i+1]-1 and cuts them into ceil(q_len / BLOCK_Q) query
    blocks; global query block ids are laid out as  qsl[i] // BLOCK_Q + i + local_block,  so request i's
    first block id is an upper bound we can binary-search without any host-side plan (and the grid,
    T // BLOCK_Q + B, depends only on the padded token and request counts: CUDA-graph safe). A decode-only
    batch (T == B) launches B query blocks, block i being request i's (DECODE_ONLY): no search, and none of
    the T // BLOCK_Q spare programs that would only search and return.

    one program's tile of rows:  BLOCK_M = BLOCK_Q * G  rows = BLOCK_Q query tokens x the G query heads
    that share this KV head (GQA), so each K/V tile read from the cache feeds G heads' dot products.

    query row at local position j (0-based within the request) sits at key position
        ctx + j,   ctx = seq_len - q_len   (tokens cached before this step: prefix hits, earlier chunks)
    and sees key p when  p <= ctx + j  and, with a window W,  p > ctx + j - W.

Launch configuration (rows, tile, warps, stages and the switches below) comes from the table in
triton/tuning.py, chosen by new tokens per request. Switches (constexpr): REVERSE maps program i to query
block n - 1 - i, so each request's longest causal blocks start first and the grid ends on short ones;
PACK_GQA=False gives each program BLOCK_M tokens of one query head (grid axis 1 = query heads) instead of
BLOCK_Q tokens x G heads; K_ROWS loads K as [TILE_N, HEAD] rows and transposes it in the dot;
HEADS_FIRST swaps grid axes 0 and 1, so that programs launched one after another are one request's KV heads
instead of one KV head's requests. In the NHD pages a token's KV heads lie side by side (2 KB a token at
8 heads x 128 x bf16): in the default order the programs running at once each read 256-byte pieces of many
pages, with HEADS_FIRST they read the whole rows of fewer pages: 1-2.5 % faster decode on the H200
(triton/tuning.py NOTE 8). Grid axis 1 holds at most 65,535 query blocks; a larger grid keeps the default order.

Keys are read TILE_N at a time; each key's physical block comes from the block table, so TILE_N need not
equal the page size. Softmax is online (running max m, running sum l) in float32, scores in log2 units
(exp2); the accumulator is float32; P is cast to the cache dtype for the second dot (as FlashAttention
does). Tiles that every row of the block sees in full run without a mask; only the diagonal tiles (or,
with a sliding window, all tiles) build one.

FP8 KV cache (float8_e4m3fn, one scale per tensor for K and one for V): reshape_and_cache stores
clamp(x / scale, +-448) in fp8; the attention kernel widens each K/V tile to the query dtype right after the
load (the dots then run as for a 16-bit cache) and applies the scales where they cost nothing: k_scale is
folded into the softmax scale (q . k_scale*k = k_scale * q . k) and v_scale multiplies the normalised
output once (P @ (v_scale * v) = v_scale * P @ v).

Split-KV (flash-decoding): with num_segments > 1 each program covers one contiguous segment of the tiles and
writes an un-normalised partial output, its max and its exp-sum; `_reduce_segments` merges them. The counts are
run-time arguments (SPLIT is the compile-time switch): one compiled variant serves every split factor, where a
constexpr count compiled one per factor and per cascade width (~25 Triton compiles at a cold start).
Long-context decode batches have too few (request, KV head) programs to fill 132 SMs; segments multiply them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, cast

import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import is_fp8, launch
from pagedllm.plugins.attention.triton.tuning import AttentionConfig, choose_config

# Merge programs take several heads each above this many (token, head) rows (_reduce_segments_kernel).
MERGE_HEADS_MIN_ROWS = 4096

# The shared-prefix length a cascade step uses is rounded down to this many keys, so that the prefix kernel's
# and the suffix kernel's tiles (TILE_N of 16, 32 or 64) both end exactly at it; a launch whose suffix tile is
# longer (DECODE_BIG's 128 keys) rounds to its tile instead (the kernels' ALIGN).
CASCADE_ALIGN = tl.constexpr(64)


@triton.jit
def _find_seq(qsl_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with qsl[i] // BLOCK_Q + i <= target (binary search over the B + 1 offsets)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        val = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def softcap_log2(s, qk_scale, soft_cap):
    """Raw scores -> cap * tanh(s * scale / cap) in log2 units (tanh via exp: not every Triton has tl tanh)."""
    s = s * (qk_scale * 0.6931471805599453)
    s = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * s / soft_cap)) - 1.0)
    return s * 1.4426950408889634


@triton.jit
def softmax_step(s, m_i, qk_scale, USE_SOFTCAP: tl.constexpr):
    """One online-softmax step over a tile of masked scores: (p, alpha, m_new), all in log2 units.

    Without a soft-cap the raw scores stay unscaled: the row max is scaled once per row (the scale is
    positive) and exp2's argument is one FMA per score, s * qk_scale - m, not a multiply and a subtract. A row
    with nothing visible yet keeps m = -inf and is shifted by 0, so exp2() gives 0, not NaN.
    Shared by the paged kernel and the fresh-prefill one (triton/prefill.py)."""
    if USE_SOFTCAP:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None]) if USE_SOFTCAP else tl.exp2(s * qk_scale - m_safe[:, None])
    return p, tl.exp2(m_i - m_safe), m_new


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, tile, k_base, stride_c_kv, stride_c_blk, stride_c_slot, bt_row, seq_len, key_limit,
    row_ok, offs_n, offs_d, d_ok, qk_scale, soft_cap, window,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, EVEN_D: tl.constexpr, K_ROWS: tl.constexpr,
):
    """One TILE_N-key step of the online softmax (scores in log2 units); returns the new (acc, m, l)."""
    key_pos = tile * TILE_N + offs_n
    if MASKED:
        key_ok = key_pos < seq_len
        blk = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        key_ok = offs_n >= 0  # all true: the tile lies inside seq_len
        blk = tl.load(bt_row + key_pos // BLOCK_SIZE)
    kv_off = blk.to(tl.int64) * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_slot
    # K as the dot's [HEAD, TILE_N] operand: either gathered transposed, or as [TILE_N, HEAD] rows (each key's
    # HEAD contiguous elements, like V) and transposed in shared memory by tl.trans (K_ROWS).
    if K_ROWS:
        k_ptrs = k_base + kv_off[:, None] + offs_d[None, :]
    else:
        k_ptrs = k_base + kv_off[None, :] + offs_d[:, None]
    v_ptrs = k_base + stride_c_kv + kv_off[:, None] + offs_d[None, :]
    if MASKED or not EVEN_D:
        if K_ROWS:
            k = tl.load(k_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:  # a full tile of a power-of-two head: no predicates on the copies
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if KV_FP8:  # widen to the query dtype; the scales are applied outside (see the top of this file)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) if K_ROWS else tl.dot(q, k)
    if USE_SOFTCAP:
        s = softcap_log2(s, qk_scale, soft_cap)
    if MASKED:
        visible = key_ok[None, :] & (key_pos[None, :] <= key_limit[:, None]) & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > key_limit[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    p, alpha, m_new = softmax_step(s, m_i, qk_scale, USE_SOFTCAP)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


# num_seqs changes every step, the segment counts with the batch size: without do_not_specialize Triton would
# compile a variant for 1, for multiples of 16, ... (start-up: each variant is a compile, NOTE on split-KV)
@triton.jit(do_not_specialize=["num_seqs", "num_segments", "seg_total"])
def _unified_attention_kernel(
    q_ptr, cache_ptr, out_ptr,
    seg_out_ptr, seg_max_ptr, seg_sum_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr, cascade_ptr,
    num_seqs, scale, soft_cap, window, v_scale, num_segments, seg_total,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h,
    stride_bt,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    CASCADE: tl.constexpr = False, REVERSE: tl.constexpr = False, PACK_GQA: tl.constexpr = True,
    K_ROWS: tl.constexpr = False, ALIGN: tl.constexpr = CASCADE_ALIGN, HEADS_FIRST: tl.constexpr = False,
    DECODE_ONLY: tl.constexpr = False,
):
    # The grid is (query blocks, heads, segments), or (heads, query blocks, segments) with HEADS_FIRST.
    if HEADS_FIRST:
        qblock, head_axis, num_qblocks = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    else:
        qblock, head_axis, num_qblocks = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    if REVERSE:  # triton/tuning.py NOTE 2: each request's longest causal query blocks start first
        qblock = num_qblocks - 1 - qblock
    kv_head = head_axis
    if not PACK_GQA:  # the head axis is the query head; its rows are BLOCK_Q = BLOCK_M tokens of that head
        kv_head = head_axis // G
    segment = tl.program_id(2)

    if DECODE_ONLY:  # one query token per request: program i is request i's (no search, no spare programs)
        seq = qblock
        q_start = seq
        q_len = 1
        local_block = 0
    else:
        seq = _find_seq(qsl_ptr, qblock, num_seqs, BLOCK_Q)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        local_block = qblock - (q_start // BLOCK_Q + seq)
        if local_block * BLOCK_Q >= q_len:  # a spare program of the upper-bound grid
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    if PACK_GQA:
        q_pos = local_block * BLOCK_Q + offs_m // G  # position within this step's queries
        head = kv_head * G + offs_m % G
    else:
        q_pos = local_block * BLOCK_Q + offs_m
        head = tl.full([BLOCK_M], 0, tl.int32) + head_axis
    row_ok = q_pos < q_len
    d_ok = offs_d < HEAD
    q = tl.load(
        q_ptr + (q_start + q_pos)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    key_limit = ctx + q_pos  # last key position each row may see

    # Keys this query block needs: up to its last row's position (the causal frontier), at most seq_len.
    last = tl.minimum(ctx + local_block * BLOCK_Q + BLOCK_Q, seq_len)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(ctx + local_block * BLOCK_Q - window + 1, 0)
    if CASCADE:  # the shared prefix's keys are _prefix_attention_kernel's (NOTE on cascade below)
        prefix = tl.load(cascade_ptr) // ALIGN * ALIGN
        first = tl.where(tl.load(cascade_ptr + 2 + seq) != 0, prefix, 0)
    tile_lo = first // TILE_N
    tile_hi = (last + TILE_N - 1) // TILE_N
    if SPLIT:
        per_seg = (tile_hi - tile_lo + num_segments - 1) // num_segments
        tile_lo = tile_lo + segment * per_seg
        tile_hi = tl.minimum(tile_hi, tile_lo + per_seg)

    # NOTE: tiles wholly at or before the block's first query position are visible to every row (and wholly
    # inside seq_len): they skip the mask. Only the diagonal tiles (and, with a window, all) pay for it.
    full_hi = tile_lo
    if not USE_WINDOW:
        full_hi = tl.minimum(tl.maximum((ctx + local_block * BLOCK_Q + 1) // TILE_N, tile_lo), tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
    offs_n = tl.arange(0, TILE_N)
    k_base = cache_ptr + kv_head * stride_c_h
    bt_row = block_table_ptr + seq * stride_bt
    # Scores in log2 units: exp2 is one instruction, exp is exp2 plus a multiply.
    qk_scale = scale * 1.4426950408889634
    for tile in range(tile_lo, full_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile, k_base, stride_c_kv, stride_c_blk, stride_c_slot, bt_row, seq_len, key_limit,
            row_ok, offs_n, offs_d, d_ok, qk_scale, soft_cap, window,
            BLOCK_SIZE, TILE_N, False, USE_WINDOW, USE_SOFTCAP, KV_FP8, HEAD == HEAD_PAD, K_ROWS,
        )
    for tile in range(full_hi, tile_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile, k_base, stride_c_kv, stride_c_blk, stride_c_slot, bt_row, seq_len, key_limit,
            row_ok, offs_n, offs_d, d_ok, qk_scale, soft_cap, window,
            BLOCK_SIZE, TILE_N, True, USE_WINDOW, USE_SOFTCAP, KV_FP8, HEAD == HEAD_PAD, K_ROWS,
        )

    out_mask = row_ok[:, None] & d_ok[None, :]
    rows = (q_start + q_pos).to(tl.int64)
    # A cascade step whose prefix is 0 at run time (no shared prefix this step) writes its output directly, as
    # a plain step does; the merge kernel then returns at once (unsplit steps only).
    partial = SPLIT
    if CASCADE:
        partial = partial or (tl.load(cascade_ptr) // ALIGN > 0)
    if partial:
        # Partials indexed [token, head, segment]: un-normalised acc plus (max, sum) for the merge.
        sidx = (rows * NUM_HEADS + head) * seg_total + segment
        tl.store(seg_out_ptr + sidx[:, None] * HEAD_PAD + offs_d[None, :], acc * v_scale, mask=out_mask)
        tl.store(seg_max_ptr + sidx, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + sidx, l_i, mask=row_ok)
    else:
        out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_segments", "prefix_segments", "seg_total"])
def _prefix_attention_kernel(
    q_ptr, cache_ptr, seg_out_ptr, seg_max_ptr, seg_sum_ptr, block_table_ptr, cascade_ptr,
    num_seqs, scale, soft_cap, v_scale, num_segments, prefix_segments, seg_total,
    stride_qt, stride_qh, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h, stride_bt,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, ALIGN: tl.constexpr = CASCADE_ALIGN,
):
    """Cascade stage 1 for a decode-only batch: the keys every sharing request has in common, read once.

    Rows are (request, query head of this KV head) pairs of many requests -- each decode request is one query
    token at row == request -- so one K/V tile read feeds BLOCK_M / G requests' dot products on tensor cores.
    Writes partial segments num_segments .. num_segments + prefix_segments - 1 of each sharing row.
    """
    rtile = tl.program_id(0)
    kv_head = tl.program_id(1)
    pseg = tl.program_id(2)
    prefix = tl.load(cascade_ptr) // ALIGN * ALIGN
    if prefix == 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    r = rtile * BLOCK_M + offs_m
    req = r // G
    head = kv_head * G + r % G
    row_ok = req < num_seqs
    row_ok = row_ok & (tl.load(cascade_ptr + 2 + req, mask=row_ok, other=0) != 0)  # this request shares
    d_ok = offs_d < HEAD
    q = tl.load(q_ptr + req[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    n_tiles = prefix // TILE_N  # prefix is a multiple of ALIGN, itself a multiple of TILE_N
    per_seg = (n_tiles + prefix_segments - 1) // prefix_segments
    tile_lo = pseg * per_seg
    tile_hi = tl.minimum(n_tiles, tile_lo + per_seg)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
    offs_n = tl.arange(0, TILE_N)
    k_base = cache_ptr + kv_head * stride_c_h
    qk_scale = scale * 1.4426950408889634
    key_limit = tl.full([BLOCK_M], 0, tl.int32)  # unused: every prefix key is visible to every row
    bt_row = block_table_ptr + tl.load(cascade_ptr + 1) * stride_bt  # a sharing request's table holds the prefix
    for tile in range(tile_lo, tile_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile, k_base, stride_c_kv, stride_c_blk, stride_c_slot, bt_row, prefix,
            key_limit, row_ok, offs_n, offs_d, d_ok, qk_scale, soft_cap, 0,
            BLOCK_SIZE, TILE_N, False, False, USE_SOFTCAP, KV_FP8, HEAD == HEAD_PAD, False,
        )
    sidx = (req.to(tl.int64) * NUM_HEADS + head) * seg_total + num_segments + pseg
    tl.store(seg_out_ptr + sidx[:, None] * HEAD_PAD + offs_d[None, :], acc * v_scale,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(seg_max_ptr + sidx, m_i, mask=row_ok)
    tl.store(seg_sum_ptr + sidx, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_segments", "seg_total"])
def _reduce_segments_kernel(
    out_ptr, seg_out_ptr, seg_max_ptr, seg_sum_ptr, cascade_ptr, stride_ot, stride_oh, num_segments, seg_total,
    NUM_HEADS: tl.constexpr, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, CASCADE: tl.constexpr,
    CHUNK: tl.constexpr, HEADS: tl.constexpr = 1, ALIGN: tl.constexpr = CASCADE_ALIGN,
):
    """Merge a row's partial segments, CHUNK at a time in one pass (the counts are run-time values: one
    compiled variant), for HEADS heads of token t per program. One pass with a running maximum: each chunk is
    one round of loads (maxima, sums and the [CHUNK, HEAD] outputs together), where two passes of 8 cost a
    one-token decode's merge 4.5 us on the H200 (docs/perf-notes.md §12). Several heads per program matter
    for cascade-capable graphs of large batches whose prefix is 0 at run time: every program returns at once,
    and 16,000 of them (500 tokens x 32 heads) still cost ~10 us a layer (perf-notes §14e)."""
    t = tl.program_id(0).to(tl.int64)
    # Segments [0, num_segments) are the row's own keys; with a cascade, [num_segments, seg_total) hold the
    # shared prefix's partials, written only for sharing rows (row t is request t) and a prefix > 0.
    n_valid = num_segments
    if CASCADE:
        prefix = tl.load(cascade_ptr) // ALIGN
        if num_segments == 1 and prefix == 0:  # the attention kernel wrote the output itself
            return
        n_valid = tl.where((prefix > 0) & (tl.load(cascade_ptr + 2 + t) != 0), seg_total, num_segments)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_PAD)
    for i in tl.static_range(HEADS):
        h = tl.program_id(1) * HEADS + i
        base = (t * NUM_HEADS + h) * seg_total
        m_all = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
        acc = tl.zeros([HEAD_PAD], tl.float32)
        for c in range(0, n_valid, CHUNK):
            ok = c + offs_c < n_valid
            idx = base + c + offs_c
            m = tl.load(seg_max_ptr + idx, mask=ok, other=float("-inf"))  # log2 units; empty: -inf
            ssum = tl.load(seg_sum_ptr + idx, mask=ok, other=0.0)
            part = tl.load(seg_out_ptr + idx[:, None] * HEAD_PAD + offs_d[None, :], mask=ok[:, None], other=0.0)
            m_new = tl.maximum(m_all, tl.max(m, axis=0))
            shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: weights exp2(-inf) = 0
            alpha = tl.exp2(m_all - shift)
            w = tl.exp2(m - shift)
            total = total * alpha + tl.sum(ssum * w, axis=0)
            acc = acc * alpha + tl.sum(part * w[:, None], axis=0)
            m_all = m_new
        out = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD)


def unified_attention(
    query: torch.Tensor,  # [T, num_heads, head]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head]
    out: torch.Tensor,  # [T, num_heads, head]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_blocks] int32
    num_seqs: int,
    num_tokens: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_segments: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tile_n: int | None = None,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    cascade: torch.Tensor | None = None,
    prefix_segments: int = 1,
    config: AttentionConfig | None = None,
    search: bool = False,
) -> torch.Tensor:
    """Causal paged attention over a mixed prefill+decode batch; `num_segments` > 1 splits each context.

    `cascade` (decode-only batches: int32 [P, s, flag_0 .. flag_{B-1}] on the device) runs the cascade: the
    requests whose flag is set share their first P keys (rounded down to CASCADE_ALIGN or the tile), held in request s's
    blocks; _prefix_attention_kernel reads them once for all of those (split `prefix_segments` ways), the
    unified kernel the rest per request, and the reduction merges both. P = 0 at run time is a plain step.

    The launch configuration is triton_tuning.choose_config's (by tokens per request) unless `config` is given;
    `tile_n` (keys per iteration), `rows_per_program` (BLOCK_M), `num_warps` and `num_stages` then override
    single fields (tuning sweeps); `search` launches a decode-only batch on the searched upper-bound grid too
    (sweeps time what DECODE_ONLY saves). `out` is written for rows < num_tokens. An fp8 cache is read back as
    k_scale * K and v_scale * V (the scales reshape_and_cache divided by).
    """
    _, num_heads, head = query.shape
    kv_heads = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    group = num_heads // kv_heads
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.is_contiguous()
    cfg = config or choose_config(num_tokens, num_seqs, num_segments)
    overrides = {"rows": rows_per_program, "tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages}
    cfg = replace(cfg, **cast(dict[str, Any], {k: v for k, v in overrides.items() if v}))
    # tl.dot needs every dimension >= 16. Packed GQA: BLOCK_M rows = BLOCK_Q tokens x G heads of one KV head,
    # so at least one token's G heads; unpacked: BLOCK_M tokens of one query head.
    block_m = max(16, cfg.rows, triton.next_power_of_2(group) if cfg.pack_gqa else 16)
    block_q = block_m // group if cfg.pack_gqa else block_m
    head_pad = max(16, triton.next_power_of_2(head))
    # The interpreter's default tile is small (more tiles per test batch) unless one was asked for.
    tile = 16 if _interpreting() and config is None and not tile_n else cfg.tile_n
    # A decode-only batch (one token per request: every request has at least one) needs one program per
    # request and head; otherwise the upper-bound grid of the module docstring, searched per program.
    decode_only = num_tokens == num_seqs and not search
    qblocks = num_seqs if decode_only else num_tokens // block_q + num_seqs
    grid = (qblocks, kv_heads if cfg.pack_gqa else num_heads, num_segments)
    heads_first = cfg.heads_first and qblocks < 65536  # CUDA's grid axis 1 limit
    if heads_first:
        grid = (grid[1], grid[0], num_segments)
    use_cascade = cascade is not None
    # The shared prefix ends on a whole suffix tile (and a whole prefix tile): CASCADE_ALIGN or the tile.
    align = max(CASCADE_ALIGN.value, tile)
    seg_total = num_segments + (prefix_segments if use_cascade else 0)
    if seg_total > 1:
        rows = num_tokens * num_heads * seg_total
        seg_out = torch.empty(rows * head_pad, dtype=torch.float32, device=query.device)
        seg_max = torch.empty(rows, dtype=torch.float32, device=query.device)
        seg_sum = torch.empty(rows, dtype=torch.float32, device=query.device)
    else:
        seg_out = seg_max = seg_sum = out  # unused
    cascade_arg = cascade if use_cascade else seq_lens  # any int32 tensor: unread without CASCADE
    launch(
        _unified_attention_kernel, grid,
        query, kv_cache, out, seg_out, seg_max, seg_sum,
        query_start_loc, seq_lens, block_table, cascade_arg,
        num_seqs, scale * k_scale, soft_cap or 0.0, sliding_window or 0, v_scale, num_segments, seg_total,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        NUM_HEADS=num_heads, G=group, HEAD=head, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=soft_cap is not None,
        SPLIT=num_segments > 1, KV_FP8=is_fp8(kv_cache.dtype), CASCADE=use_cascade,
        REVERSE=cfg.reverse, PACK_GQA=cfg.pack_gqa, K_ROWS=cfg.k_rows, ALIGN=align, HEADS_FIRST=heads_first,
        DECODE_ONLY=decode_only,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if use_cascade:
        assert sliding_window is None and num_tokens == num_seqs, "cascade: decode-only batches, no window"
        prefix_tile = 16 if _interpreting() else 64
        assert align % tile == 0 and align % prefix_tile == 0, "both kernels' tiles must end at the aligned prefix"
        prefix_m = max(64, triton.next_power_of_2(group))
        launch(
            _prefix_attention_kernel, (triton.cdiv(num_seqs * group, prefix_m), kv_heads, prefix_segments),
            query, kv_cache, seg_out, seg_max, seg_sum, block_table, cascade_arg,
            num_seqs, scale * k_scale, soft_cap or 0.0, v_scale, num_segments, prefix_segments, seg_total,
            query.stride(0), query.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
            NUM_HEADS=num_heads, G=group, HEAD=head, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=prefix_m,
            TILE_N=prefix_tile, USE_SOFTCAP=soft_cap is not None, KV_FP8=is_fp8(kv_cache.dtype), ALIGN=align,
        )
    if seg_total > 1:
        # Heads per merge program: one while the grid is small (a split single stream keeps every head in
        # parallel), up to 8 for large batches (far fewer programs when a cascade graph's prefix is 0).
        heads = math.gcd(num_heads, 8) if num_tokens * num_heads > MERGE_HEADS_MIN_ROWS else 1
        launch(
            _reduce_segments_kernel, (num_tokens, num_heads // heads),
            out, seg_out, seg_max, seg_sum, cascade_arg, out.stride(0), out.stride(1), num_segments, seg_total,
            NUM_HEADS=num_heads, HEAD=head, HEAD_PAD=head_pad, CASCADE=use_cascade, CHUNK=32, HEADS=heads,
            ALIGN=align,
        )
    return out


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
