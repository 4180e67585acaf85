"""Triton kernels that read GGUF blocks as the file stores them: a decode GEMV and a dequantize-to-scratch pass.

The weight stays a uint8 [N, bytes per row] tensor in ggml's block layout (formats/gguf_blocks.py draws the 32-weight
types; the K-quants are super-blocks of 256 weights, laid out as ggml-common.h / gguf-py's quants.py). Nothing
is repacked, so the resident bytes are the file's. Both kernels evaluate one weight per tile element with
`_weights` below, from its column c: the block b = c // QK, the index i = c % QK, and the block's fields:

    Q4_0  18 B  d | qs[16]                      q = qs[i % 16] >> 4 (i // 16) & 15          w = d (q - 8)
    Q4_1  20 B  d | m | qs[16]                  as Q4_0                                     w = d q + m
    Q5_0  22 B  d | qh[4] | qs[16]              q = nibble | (qh[i // 8] >> i % 8 & 1) << 4 w = d (q - 16)
    Q5_1  24 B  d | m | qh[4] | qs[16]          as Q5_0                                     w = d q + m
    Q8_0  34 B  d | qs[32] int8                 q = qs[i]                                   w = d q
    Q2_K  84 B  sc[16] | qs[64] | d | dmin      q = qs[32 (i // 128) + i % 32] >> 2 (i % 128 // 32) & 3
                                                s = sc[i // 16]:  w = (d (s & 15)) q - dmin (s >> 4)
    Q3_K  110 B hm[32] | qs[64] | sc[12] | d    q = (2-bit as Q2_K) - 4 (1 - (hm[i % 32] >> i // 32 & 1))
                                                s = 6-bit scale j = i // 16, minus 32:  w = (d s) q
    Q4_K  144 B d | dmin | sc[12] | qs[128]     q = qs[32 (i // 64) + i % 32] >> 4 (i % 64 // 32) & 15
                                                (s, m) = 6-bit pair j = i // 32:  w = (d s) q - dmin m
    Q5_K  176 B d | dmin | sc[12] | qh[32] | qs as Q4_K, q |= (qh[i % 32] >> i // 32 & 1) << 4
    Q6_K  210 B ql[128] | qh[64] | sc[16] i8 | d
                                                q = (ql[64 (i // 128) + i % 64] >> 4 (i % 128 // 64) & 15
                                                     | (qh[32 (i // 128) + i % 32] >> 2 (i % 128 // 32) & 3) << 4) - 32
                                                w = (d sc[i // 16]) q

Every block size and field offset is even, so the f16 fields are read as one 2-byte load through a
float16 pointer (the row stride is even and torch's allocations are aligned); everything else is byte loads.
The products are formed in float32 in gguf-py's order (d * scale first, then * q, then - min), so the
dequantized weights equal gguf-py's float32 values before the one rounding to the output dtype.

    _gguf_dequant_kernel    grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)): W tile -> out [N, K] (fp16/bf16/fp32);
                            the prefill path (M > GEMV_MAX_M) then runs cuBLAS on the scratch matrix
    _gguf_gemv_kernel       grid (cdiv(N, BLOCK_N),): a program owns BLOCK_N output rows and walks K in
                            BLOCK_K steps; y[m, n] += sum_k W[n, k] x[m, k] for up to 8 rows, float32

NOTE 1 (why element-wise): one code path for ten formats, checked bit for bit against gguf-py under the
interpreter. The cost is redundant loads: a Q4_0 weight reads its block's d (a 2-byte load, L1-resident after
the first) and a nibble byte shared with one neighbour, ~2 loads per weight where a block-wise kernel needs
~0.3. Decode is then load-instruction bound, not DRAM bound (docs/perf-notes.md §8 predicts by how much).
The block-wise GEMV (gguf/block_gemv.py: 16-bit words, a thread per block, split-K) now takes Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0 at M <= 4 (BLOCK_GEMV); this kernel keeps the K-quants, M = 5..8 and the fallback.
NOTE 2: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
NOTE 3 (GEMV accumulators): each activation row keeps a [BLOCK_N, BLOCK_K] float32 accumulator, reduced across
the tile once at the end; a tl.sum per step compiled to 112 shuffles per step. BLOCK_K halves from M = 3 on so
eight rows fit: sm_90 cubins use 38 registers (Q4_0, M = 1) to 128 (Q6_K, M = 8), no spills.
NOTE 4: the dequantize kernel is compiled without FMA contraction, so `d * q + m` (Q4_1, Q5_1) and the K-quants'
`(d * s) * q - dmin * m` round as gguf-py's numpy does and the scratch / row lookups are its float32 values on
the GPU too (the interpreter never contracts; the GEMV may, its sums are rounded anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.plugins.quantization.gguf.block_gemv import block_reason, gguf_block_gemv

GEMV_MAX_M = 8  # up to this many activation rows take the GEMV; more dequantize to scratch + cuBLAS
BLOCK_GEMV = True  # the 32-weight types at M <= 4 take gguf/block_gemv.py's kernel (NOTE 1); False: element-wise
# ggml type id -> (weights per block, bytes per block): the types these kernels decode.
TRITON_TYPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _f16(p):
    """The little-endian f16 at byte address p (even), as float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _k_scale_min(sc, j):
    """Q4_K / Q5_K: the 6-bit (scale, min) pair j (0..7) of the 12 packed bytes at sc."""
    lo = j < 4
    jj = j % 4
    a = _u8(sc + jj)  # scales 0..3 (low 6 bits) and the top bits of scales 4..7
    b = _u8(sc + jj + 4)  # mins 0..3 (low 6 bits) and the top bits of mins 4..7
    c = _u8(sc + jj + 8)  # scales 4..7 (low nibble), mins 4..7 (high nibble)
    s = tl.where(lo, a & 63, (c & 15) | ((a >> 2) & 48))
    m = tl.where(lo, b & 63, (c >> 4) | ((b >> 2) & 48))
    return s.to(tl.float32), m.to(tl.float32)


@triton.jit
def _weights(row, c, TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr):
    """Float32 weights at columns c of the rows whose bytes start at `row` (broadcast shapes; module doc)."""
    blk = row + (c // QK) * TS
    i = c % QK
    if TYPE == 2:  # Q4_0
        q = (_u8(blk + 2 + i % 16) >> ((i // 16) * 4)) & 15
        w = _f16(blk) * (q - 8).to(tl.float32)
    elif TYPE == 3:  # Q4_1
        q = (_u8(blk + 4 + i % 16) >> ((i // 16) * 4)) & 15
        w = _f16(blk) * q.to(tl.float32) + _f16(blk + 2)
    elif TYPE == 6:  # Q5_0
        h = (_u8(blk + 2 + i // 8) >> (i % 8)) & 1
        q = ((_u8(blk + 6 + i % 16) >> ((i // 16) * 4)) & 15) | (h << 4)
        w = _f16(blk) * (q - 16).to(tl.float32)
    elif TYPE == 7:  # Q5_1
        h = (_u8(blk + 4 + i // 8) >> (i % 8)) & 1
        q = ((_u8(blk + 8 + i % 16) >> ((i // 16) * 4)) & 15) | (h << 4)
        w = _f16(blk) * q.to(tl.float32) + _f16(blk + 2)
    elif TYPE == 8:  # Q8_0
        q = tl.load((blk + 2 + i).to(tl.pointer_type(tl.int8))).to(tl.float32)
        w = _f16(blk) * q
    elif TYPE == 10:  # Q2_K
        q = (_u8(blk + 16 + (i // 128) * 32 + i % 32) >> ((i % 128 // 32) * 2)) & 3
        s = _u8(blk + i // 16)
        w = (_f16(blk + 80) * (s & 15).to(tl.float32)) * q.to(tl.float32) - _f16(blk + 82) * (s >> 4).to(tl.float32)
    elif TYPE == 11:  # Q3_K
        q2 = (_u8(blk + 32 + (i // 128) * 32 + i % 32) >> ((i % 128 // 32) * 2)) & 3
        h = (_u8(blk + i % 32) >> (i // 32)) & 1
        q = q2 - 4 * (1 - h)
        j = i // 16
        s_lo = (_u8(blk + 96 + j % 8) >> ((j // 8) * 4)) & 15
        s_hi = (_u8(blk + 104 + j % 4) >> ((j // 4) * 2)) & 3
        s = (s_lo | (s_hi << 4)) - 32
        w = (_f16(blk + 108) * s.to(tl.float32)) * q.to(tl.float32)
    elif TYPE == 12:  # Q4_K
        q = (_u8(blk + 16 + (i // 64) * 32 + i % 32) >> ((i % 64 // 32) * 4)) & 15
        s, m = _k_scale_min(blk + 4, i // 32)
        w = (_f16(blk) * s) * q.to(tl.float32) - _f16(blk + 2) * m
    elif TYPE == 13:  # Q5_K
        h = (_u8(blk + 16 + i % 32) >> (i // 32)) & 1
        q = ((_u8(blk + 48 + (i // 64) * 32 + i % 32) >> ((i % 64 // 32) * 4)) & 15) | (h << 4)
        s, m = _k_scale_min(blk + 4, i // 32)
        w = (_f16(blk) * s) * q.to(tl.float32) - _f16(blk + 2) * m
    else:  # TYPE == 14, Q6_K
        lo = (_u8(blk + (i // 128) * 64 + i % 64) >> ((i % 128 // 64) * 4)) & 15
        hi = (_u8(blk + 128 + (i // 128) * 32 + i % 32) >> ((i % 128 // 32) * 2)) & 3
        q = (lo | (hi << 4)) - 32
        s = tl.load((blk + 192 + i // 16).to(tl.pointer_type(tl.int8))).to(tl.float32)
        w = (_f16(blk + 208) * s) * q.to(tl.float32)
    return w


@triton.jit
def _gguf_dequant_kernel(
    w_ptr, out_ptr, N, K, stride_w, stride_o,
    TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    # Out-of-range rows read row 0 and out-of-range columns column 0 (always valid bytes); the store masks them.
    n_ok = offs_n < N
    k_ok = offs_k < K
    rows = tl.where(n_ok, offs_n, 0).to(tl.int64)
    cols = tl.where(k_ok, offs_k, 0)
    w = _weights(w_ptr + rows[:, None] * stride_w, cols[None, :], TYPE, QK, TS)
    out = out_ptr + rows[:, None] * stride_o + offs_k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def _fma_row(acc, w, x_row, offs_k, k_ok):
    x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    return acc + w * x[None, :]


@triton.jit
def _store_row(y_row, acc, offs_n, n_ok, ROW: tl.constexpr, ROWS: tl.constexpr):
    if ROW < ROWS:
        tl.store(y_row + offs_n, tl.sum(acc, axis=1).to(y_row.dtype.element_ty), mask=n_ok)


@triton.jit
def _gguf_gemv_kernel(
    w_ptr, x_ptr, y_ptr, N, K, stride_w, stride_xm, stride_ym,
    TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    row = w_ptr + tl.where(n_ok, offs_n, 0).to(tl.int64)[:, None] * stride_w
    zero = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # NOTE 3
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        # Columns past K read column 0's weight; their activations load as 0, so they add nothing.
        w = _weights(row, tl.where(k_ok, offs_k, 0)[None, :], TYPE, QK, TS)
        a0 = _fma_row(a0, w, x_ptr, offs_k, k_ok)
        if ROWS > 1:
            a1 = _fma_row(a1, w, x_ptr + stride_xm, offs_k, k_ok)
        if ROWS > 2:
            a2 = _fma_row(a2, w, x_ptr + 2 * stride_xm, offs_k, k_ok)
        if ROWS > 3:
            a3 = _fma_row(a3, w, x_ptr + 3 * stride_xm, offs_k, k_ok)
        if ROWS > 4:
            a4 = _fma_row(a4, w, x_ptr + 4 * stride_xm, offs_k, k_ok)
        if ROWS > 5:
            a5 = _fma_row(a5, w, x_ptr + 5 * stride_xm, offs_k, k_ok)
        if ROWS > 6:
            a6 = _fma_row(a6, w, x_ptr + 6 * stride_xm, offs_k, k_ok)
        if ROWS > 7:
            a7 = _fma_row(a7, w, x_ptr + 7 * stride_xm, offs_k, k_ok)
    _store_row(y_ptr, a0, offs_n, n_ok, 0, ROWS)
    _store_row(y_ptr + stride_ym, a1, offs_n, n_ok, 1, ROWS)
    _store_row(y_ptr + 2 * stride_ym, a2, offs_n, n_ok, 2, ROWS)
    _store_row(y_ptr + 3 * stride_ym, a3, offs_n, n_ok, 3, ROWS)
    _store_row(y_ptr + 4 * stride_ym, a4, offs_n, n_ok, 4, ROWS)
    _store_row(y_ptr + 5 * stride_ym, a5, offs_n, n_ok, 5, ROWS)
    _store_row(y_ptr + 6 * stride_ym, a6, offs_n, n_ok, 6, ROWS)
    _store_row(y_ptr + 7 * stride_ym, a7, offs_n, n_ok, 7, ROWS)


def _check(blocks: torch.Tensor, ggml_type: int, k: int) -> tuple[int, int]:
    qk, ts = TRITON_TYPES[ggml_type]
    if k % qk or blocks.shape[1] != k // qk * ts or blocks.dtype != torch.uint8 or blocks.stride(1) != 1:
        raise ValueError(f"GGUF type {ggml_type}: blocks {tuple(blocks.shape)} do not hold rows of {k} weights")
    return qk, ts


def gguf_dequantize(blocks: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The [N, k] matrix of uint8 blocks [N, bytes per row] in `dtype` (one rounding from gguf-py's float32)."""
    qk, ts = _check(blocks, ggml_type, k)
    n = blocks.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=blocks.device)
    block_n, block_k = 16, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _gguf_dequant_kernel[grid](blocks, out, n, k, blocks.stride(0), out.stride(0),
                               TYPE=ggml_type, QK=qk, TS=ts, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                               enable_fp_fusion=False)  # NOTE 4
    return out


def gemv_blocks(n: int, m: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps): fewer output rows per program for small N (so every SM gets programs), a
    shorter K step for more activation rows (each keeps a [BLOCK_N, BLOCK_K] accumulator; NOTE 3)."""
    block_n = 16 if n >= 4096 else 8 if n >= 1024 else 4
    return block_n, 128 if m <= 2 else 64, 4


def gguf_gemv(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """y [M, n] = x [M, K] @ W^T for M <= GEMV_MAX_M, in x's dtype (float32 accumulation).

    Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 at M <= 4 take the block-wise GEMV (gguf/block_gemv.py) when BLOCK_GEMV is
    on; everything else, and any call with `tiles` (BLOCK_N, BLOCK_K, warps: overrides gemv_blocks, for the
    H200 sweep and the tests), the element-wise kernel here."""
    m, k = x.shape
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"the GGUF GEMV takes 1..{GEMV_MAX_M} rows, not {m}")
    qk, ts = _check(blocks, ggml_type, k)
    if tiles is None and BLOCK_GEMV and block_reason(x, blocks, ggml_type) is None:
        return gguf_block_gemv(x, blocks, ggml_type, n)  # NOTE 1: the block-wise kernel where it applies
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tiles or gemv_blocks(n, m)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        blocks, x, y, n, k, blocks.stride(0), x.stride(0), y.stride(0),
        TYPE=ggml_type, QK=qk, TS=ts, ROWS=m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return y


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int) -> torch.Tensor:
    """y [..., n] = x [..., K] @ W^T: the GEMV for up to GEMV_MAX_M rows, else a scratch matrix and cuBLAS."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.shape[0] <= GEMV_MAX_M and flat.shape[0] > 0:
        y = gguf_gemv(flat, blocks, ggml_type, n)
    else:
        y = flat @ gguf_dequantize(blocks, ggml_type, k, x.dtype).t()
    return y.reshape(*x.shape[:-1], n)
