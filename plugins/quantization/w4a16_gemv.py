"""A GEMV for packed integer weights (AWQ GEMM and GPTQ layouts): decode steps, M <= 8 activation rows.

    y[M, N] = x[M, K] @ W^T[K, N],   W^T[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]

Decode reads every weight once and does two FLOPs with it, so the kernel's job is to stream the packed words
at copy bandwidth and spend as few instructions per code as possible. No tl.dot (it would pad M to 16 rows
and move the dequantized tile through shared memory). A program owns BLOCK_N output columns and one slice of
K (split-K); per BLOCK_K step it loads the packed words, unpacks them with shifts and masks, multiplies by
each activation row and reduces over K in registers:

    grid (cdiv(N, BLOCK_N), SPLIT_K)            program (n block, K slice)
    GPTQ words [BLOCK_K / pf, BLOCK_N]  -> codes [BLOCK_K / pf, pf, BLOCK_N]      (inputs packed along K)
    AWQ  words [BLOCK_K, BLOCK_N / 8]   -> codes [BLOCK_K, BLOCK_N / 8, 8]        (outputs packed along N)
    partial[split, m, n] = sum over the slice   (float32; SPLIT_K = 1 writes y directly)
    y[m, n] = sum over splits, in split order   (_sum_splits_kernel: deterministic, cast to x's dtype)

NOTE 1 (instructions per code): a code becomes a float with the exponent trick, not an int->float convert
(I2F issues at a quarter of the FP32 rate on Hopper): `q | 0x4B000000` read as float32 is 2^23 + q exactly,
and the zero point is folded into the constant subtracted, `(2^23 + q) - (2^23 + z) = q - z`, exact. A code
costs shift, and/or (one LOP3), subtract, and one FMA per activation row. The group scale multiplies the
step's [M, BLOCK_N] partial sum, not every code: BLOCK_K divides the group size, so a step lies in one group.
NOTE 2 (block sizes): BLOCK_N = 256 with 2 warps lets each thread own 4 adjacent columns (one 16-byte load
per GPTQ word row) and every K row of the tile, so the reduction over K is a chain of in-thread FMAs; the
AWQ tile [BLOCK_K, 32 words] is one 128-byte line per K row. BLOCK_K = 64 at M = 1 (8 KB of words per step,
32 words per thread), smaller for more rows (the unpacked tile stays live across the rows). SPLIT_K is
raised until about eight programs per SM are in flight, at most one split per 64 * M inputs (the float32
partials stay well under the weight's bytes, and in L2). Every value is a starting point for the H200
sweep in examples/gpu/quant_bench.py; `blocks=` overrides them.
NOTE 3: act-order weights whose groups are not contiguous (g_idx kept after load) go to the GEMM, which
gathers zeros and scales per input; after the load-time sort (w4a16_method.py) that case is rare.
NOTE 4: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.plugins.quantization.w4a16_layout import PackedLayout

GEMV_MAX_M = 8  # the dispatcher (w4a16_kernel.w4a16_matmul) sends up to this many rows here


class GemvBlocks(NamedTuple):
    """Tunables of one launch (NOTE 2)."""

    block_n: int
    block_k: int
    num_warps: int
    split_k: int


@triton.jit
def _as_biased_float(v):
    """int32 v in [0, 2^23) -> float32 2^23 + v, exactly, without an int->float convert (NOTE 1)."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_gptq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_qw, stride_qz, stride_s, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BLOCK_KW: tl.constexpr = BLOCK_K // PF
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    n_ok = offs_n < N
    r = tl.arange(0, BLOCK_KW)
    j = tl.arange(0, PF)
    code_shift = (j * BITS)[None, :, None]  # [1, PF, 1]: input r * PF + j sits in bits j*BITS of word r
    x_offs = r[:, None, None] * PF + j[None, :, None]  # [BLOCK_KW, PF, 1]
    z_word = offs_n // PF
    z_shift = (offs_n % PF) * BITS
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        g = k0 // GROUP_SIZE
        zw = tl.load(qz_ptr + g * stride_qz + z_word, mask=n_ok, other=0)
        zb = _as_biased_float(((zw >> z_shift) & MASK) + ZERO_OFFSET)  # 2^23 + z
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        words = tl.load(qw_ptr + (k0 // PF + r)[:, None] * stride_qw + offs_n[None, :], mask=n_ok[None, :],
                        other=0, eviction_policy="evict_first")
        # NOTE 1: arithmetic shift then mask keeps exactly the code's bits; (2^23 + q) - (2^23 + z) = q - z.
        w = _as_biased_float((words[:, None, :] >> code_shift) & MASK) - zb[None, None, :]
        for m in tl.static_range(ROWS):
            xm = tl.load(x_ptr + m * stride_xm + k0 + x_offs).to(tl.float32)
            part = tl.sum(tl.sum(xm * w, axis=1), axis=0)  # [BLOCK_N], over this step's BLOCK_K inputs
            acc = tl.where(rows[:, None] == m, acc + (part * s)[None, :], acc)
    out = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < ROWS)[:, None] & n_ok[None, :])


@triton.jit
def _gemv_awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_qw, stride_qz, stride_s, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    BLOCK_NW: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_c = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_NW + tl.arange(0, BLOCK_NW), BLOCK_NW), BLOCK_NW)
    c_ok = offs_c < N // 8  # N is a multiple of 8: a word's eight outputs exist together
    j = tl.arange(0, 8)
    # output 8c + j sits in nibble (j % 2) * 4 + j // 2 of word c (AWQ_ORDER's inverse)
    nib_shift = (((j % 2) * 4 + j // 2) * 4)[None, :]  # [1, 8]
    offs_n = offs_c[:, None] * 8 + j[None, :]  # [BLOCK_NW, 8]
    kk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_NW, 8), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        g = k0 // GROUP_SIZE
        zw = tl.load(qz_ptr + g * stride_qz + offs_c, mask=c_ok, other=0)
        zb = _as_biased_float((zw[:, None] >> nib_shift) & 15)  # [BLOCK_NW, 8]: 2^23 + z
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=c_ok[:, None], other=0.0).to(tl.float32)
        words = tl.load(qw_ptr + (k0 + kk)[:, None] * stride_qw + offs_c[None, :], mask=c_ok[None, :],
                        other=0, eviction_policy="evict_first")
        w = _as_biased_float((words[:, :, None] >> nib_shift[None, :, :]) & 15) - zb[None, :, :]
        for m in tl.static_range(ROWS):
            xm = tl.load(x_ptr + m * stride_xm + k0 + kk).to(tl.float32)
            part = tl.sum(xm[:, None, None] * w, axis=0)  # [BLOCK_NW, 8]
            acc = tl.where(rows[:, None, None] == m, acc + (part * s)[None, :, :], acc)
    out = out_ptr + pid_k * stride_os + rows[:, None, None] * stride_om + offs_n[None, :, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < ROWS)[:, None, None] & c_ok[None, :, None])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, MN, SPLITS, BLOCK: tl.constexpr):
    """y[i] = sum over s of part[s, i], in split order (the same bits every run), cast to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLITS):
        acc += tl.load(part_ptr + split * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# About eight resident programs per SM of an H100 / H200 (132 SMs) keep ~64 KB of loads in flight per SM.
_TARGET_PROGRAMS = 1056


def gemv_blocks(layout: PackedLayout, m: int, n: int, k: int) -> GemvBlocks:
    """The launch's tunables for an [m, k] x [k, n] product (NOTE 2)."""
    block_n, warps = 256, 2
    block_k = 64 if m == 1 else 32 if m == 2 else 16
    block_k = math.gcd(block_k, layout.group_size)  # a step must lie inside one group
    col_blocks = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, col_blocks), k // block_k, k // (64 * m)))
    return GemvBlocks(block_n, block_k, warps, split)


def gemv_reason(layout: PackedLayout, m: int, g_idx: torch.Tensor | None) -> str | None:
    """Why this product cannot take the GEMV (None: it can)."""
    if m > GEMV_MAX_M:
        return f"{m} rows > {GEMV_MAX_M}"
    if g_idx is not None:
        return "act-order groups are looked up per input (NOTE 3)"
    if layout.kind == "gptq" and layout.group_size % layout.pack_factor:
        return f"group size {layout.group_size} is not a multiple of the pack factor {layout.pack_factor}"
    return None


def w4a16_gemv(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    blocks: GemvBlocks | tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(layout, ...) in x's dtype, for at most GEMV_MAX_M rows of x.

    `blocks` (BLOCK_N, BLOCK_K, num_warps, SPLIT_K) overrides gemv_blocks (tuning runs).
    """
    k = x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    assert 0 < m <= GEMV_MAX_M, f"w4a16_gemv takes 1..{GEMV_MAX_M} rows, got {m}"
    block_n, block_k, warps, split = blocks or gemv_blocks(layout, m, n, k)
    assert layout.group_size % block_k == 0 and k % block_k == 0, (block_k, layout, k)
    assert layout.kind == "awq" or block_k % layout.pack_factor == 0, (block_k, layout)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # every split owns at least one step, so every partial is written
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split)
    args = (
        flat, qweight, qzeros, scales, out,
        m, n, k, k_per_split,
        flat.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), m * n, n,
    )
    rows = dict(ROWS=m, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    if layout.kind == "awq":
        _gemv_awq_kernel[grid](*args, GROUP_SIZE=layout.group_size, **rows)
    else:
        _gemv_gptq_kernel[grid](
            *args, GROUP_SIZE=layout.group_size, BITS=layout.bits, ZERO_OFFSET=layout.zero_offset, **rows
        )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split, BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], n)
