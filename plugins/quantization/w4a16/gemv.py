"""A GEMV for packed integer weights in the GPTQ order: decode steps, M <= 8 activation rows.

    y[M, N] = x[M, K] @ W^T[K, N],   W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    qweight [K / pf, N] int32 (pf = 32 / bits codes of consecutive inputs per word), qzeros [G, N / pf],
    scales [G, N]; AWQ checkpoints are repacked into this order at load (w4a16_layout.awq_to_gptq).

Decode reads every weight once and does two FLOPs with it, so the kernel's job is to stream the packed words
at copy bandwidth and spend as few instructions per code as possible. No tl.dot (it would pad M to 16 rows
and move the dequantized tile through shared memory). A program owns BLOCK_N output columns and one slice of
K (split-K) and walks it in BLOCK_K steps; each step streams BLOCK_K / pf rows of words:

    grid (cdiv(N, BLOCK_N), SPLIT_K)               program (n block, K slice)
    per word row r, per code j (both unrolled)     w = q - z for the BLOCK_N columns,  p_m += x[m, k] * w
    per step (one group)                           acc_m += p_m * s
    partial[split, m, n] = acc_m                   float32; SPLIT_K = 1 writes y directly
    y[m, n] = sum over splits, in split order      _sum_splits_kernel: deterministic, cast to x's dtype

NOTE 1 (instructions per code): a code becomes a float with the exponent trick, not an int->float convert
(I2F issues at a quarter of the FP32 rate): `q | 0x4B000000` read as float32 is 2^23 + q exactly, and the
zero point is folded into the constant subtracted, `(2^23 + q) - (2^23 + z) = q - z`, exact. A code costs
shift, and/or (one LOP3), subtract and one FMA per activation row; the group scale multiplies the step's
partial sums, not every code (BLOCK_K divides the group size, so a step lies in one group). The code mask is a
kernel argument, not a constant: with a constant LLVM turns shift + mask into a bit-field extract, which
ptxas expands to SHF + SGXT, and the OR then needs its own LOP3 (one instruction more per code, -11 %).
NOTE 2 (layouts; checked by compiling for sm_90 on the CPU, see docs/perf-notes.md): every tensor is 1-D over
the program's BLOCK_N columns, 4 adjacent columns per thread (one 16-byte load per word row), so nothing is
reduced across threads and Triton inserts no layout conversion. The activations are read as scalars
(uniform loads from L1) and the M rows keep separate accumulators (_fma_rows, unrolled by ROWS), because a
[M, BLOCK_K] tile of x would need its own layout and a conversion through shared memory every step. An
earlier version with 3-D [K/pf, pf, N] tiles compiled to cross-warp reductions and spilled.
NOTE 3 (block sizes): BLOCK_N = 256 with 2 warps; BLOCK_K = 128 at M = 1 (16 KB of words per step, 56
registers), fewer for more rows (each row's partial sums are live across the step). SPLIT_K is raised until
about eight programs per SM are in flight, at most one split per 64 * M inputs (the float32 partials stay
well under the weight's bytes, and in L2). Starting points for the H200 sweep in
examples/gpu/quant_bench.py; `blocks=` overrides them.
NOTE 4: act-order weights whose groups are not contiguous (g_idx kept after load) go to the GEMM, which
gathers zeros and scales per input; after the load-time sort (w4a16/method.py) that case is rare.
NOTE 5: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

GEMV_MAX_M = 8  # the dispatcher (w4a16_kernel.w4a16_matmul) sends up to this many rows here
# The kernel decode takes: "base" (this file's) or one of w4a16_gemv_tiled.TILED_VARIANTS ("tile", "tile_pf",
# "mant", "mant_pf"), which fall back here for what they refuse (tiled_reason). Picked from the H200 sweep,
# examples/gpu/w4_gemv_sweep.py (2026-11-29: mant 60.7 us per 8B layer at M = 1 = 1.94x bf16, base 94.1).
GEMV_VARIANT = "mma"
# "mma" (w4a16/mma.py, tensor cores, CUDA C through NVRTC) falls back to "mant" where mma_reason refuses or
# NVRTC is missing. H200 per 8B layer (docs/benchmarks.md, tenth pass, 2026-11-30 08:31 UTC): M = 1 43.3 vs mant
# 53.5 µs, M = 2 43.6, M = 4 45.2, M = 8 49.4 (mant: 79.0 at 2, 130.7 at 4, ninth pass); GPTQ W3 2.34 ms.
GEMV_VARIANTS = ("mma", "mant", "mant_pf", "tile", "tile_pf", "base")


def gemv_variant() -> str:
    """GEMV_VARIANT, or $PAGEDLLM_W4A16_GEMV (one of GEMV_VARIANTS) for A/B runs on the GPU."""
    got = os.environ.get("PAGEDLLM_W4A16_GEMV", GEMV_VARIANT)
    if got not in GEMV_VARIANTS:
        raise ValueError(f"PAGEDLLM_W4A16_GEMV={got!r}: expected one of {', '.join(GEMV_VARIANTS)}")
    return got


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
def _fma_rows(p0, p1, p2, p3, p4, p5, p6, p7, x_k, stride_xm, w, ROWS: tl.constexpr):
    """p_m += x[m, k] * w for the ROWS activation rows (x_k points at x[0, k]; scalar loads, NOTE 2)."""
    p0 += tl.load(x_k).to(tl.float32) * w
    if ROWS > 1:
        p1 += tl.load(x_k + stride_xm).to(tl.float32) * w
    if ROWS > 2:
        p2 += tl.load(x_k + 2 * stride_xm).to(tl.float32) * w
    if ROWS > 3:
        p3 += tl.load(x_k + 3 * stride_xm).to(tl.float32) * w
    if ROWS > 4:
        p4 += tl.load(x_k + 4 * stride_xm).to(tl.float32) * w
    if ROWS > 5:
        p5 += tl.load(x_k + 5 * stride_xm).to(tl.float32) * w
    if ROWS > 6:
        p6 += tl.load(x_k + 6 * stride_xm).to(tl.float32) * w
    if ROWS > 7:
        p7 += tl.load(x_k + 7 * stride_xm).to(tl.float32) * w
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _store_row(out_row, acc, n_ok, ROW: tl.constexpr, ROWS: tl.constexpr):
    if ROW < ROWS:
        tl.store(out_row, acc.to(out_row.dtype.element_ty), mask=n_ok)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr,
    N, K, K_PER_SPLIT,
    stride_xm, stride_qw, stride_qz, stride_s, stride_os, stride_om,
    code_mask,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    n_ok = offs_n < N
    z_word = offs_n // PF
    z_shift = (offs_n % PF) * BITS
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        g = k0 // GROUP_SIZE
        zw = tl.load(qz_ptr + g * stride_qz + z_word, mask=n_ok, other=0)
        zb = _as_biased_float(((zw >> z_shift) & MASK) + ZERO_OFFSET)  # 2^23 + z
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        p0, p1, p2, p3, p4, p5, p6, p7 = zero, zero, zero, zero, zero, zero, zero, zero
        for r in tl.static_range(BLOCK_K // PF):  # one row of words: inputs k0 + r * PF .. + PF - 1
            words = tl.load(qw_ptr + (k0 // PF + r) * stride_qw + offs_n, mask=n_ok, other=0,
                            eviction_policy="evict_first")
            for j in tl.static_range(PF):
                # NOTE 1: arithmetic shift then mask keeps the code's bits; (2^23 + q) - (2^23 + z) = q - z.
                w = _as_biased_float((words >> (j * BITS)) & code_mask) - zb
                p0, p1, p2, p3, p4, p5, p6, p7 = _fma_rows(
                    p0, p1, p2, p3, p4, p5, p6, p7, x_ptr + k0 + r * PF + j, stride_xm, w, ROWS
                )
        a0 += p0 * s
        a1 += p1 * s
        a2 += p2 * s
        a3 += p3 * s
        a4 += p4 * s
        a5 += p5 * s
        a6 += p6 * s
        a7 += p7 * s
    out = out_ptr + pid_k * stride_os + offs_n
    _store_row(out, a0, n_ok, 0, ROWS)
    _store_row(out + stride_om, a1, n_ok, 1, ROWS)
    _store_row(out + 2 * stride_om, a2, n_ok, 2, ROWS)
    _store_row(out + 3 * stride_om, a3, n_ok, 3, ROWS)
    _store_row(out + 4 * stride_om, a4, n_ok, 4, ROWS)
    _store_row(out + 5 * stride_om, a5, n_ok, 5, ROWS)
    _store_row(out + 6 * stride_om, a6, n_ok, 6, ROWS)
    _store_row(out + 7 * stride_om, a7, n_ok, 7, ROWS)


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, MN, SPLITS, BLOCK: tl.constexpr):
    """y[i] = sum over s of part[s, i], in split order (the same bits every run), cast to y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLITS):
        acc += tl.load(part_ptr + split * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# About eight resident programs per SM of an H100 / H200 (132 SMs) keep enough loads in flight per SM.
_TARGET_PROGRAMS = 1056


def gemv_blocks(layout: PackedLayout, m: int, n: int, k: int) -> GemvBlocks:
    """The launch's tunables for an [m, k] x [k, n] product (NOTE 3)."""
    block_n, warps = 256, 2
    block_k = 128 if m == 1 else 32 if m == 2 else 16
    block_k = max(math.gcd(block_k, layout.group_size), layout.pack_factor)  # a step lies inside one group
    col_blocks = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, col_blocks), k // block_k, k // (64 * m)))
    return GemvBlocks(block_n, block_k, warps, split)


def gemv_reason(layout: PackedLayout, m: int, g_idx: torch.Tensor | None) -> str | None:
    """Why this product cannot take the GEMV (None: it can)."""
    if m > GEMV_MAX_M:
        return f"{m} rows > {GEMV_MAX_M}"
    if layout.kind != "gptq":
        return f"{layout.kind} packing (AWQ is repacked into the GPTQ order at load: w4a16_layout.awq_to_gptq)"
    if g_idx is not None:
        return "act-order groups are looked up per input (NOTE 4)"
    if layout.group_size % layout.pack_factor:
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
    variant: str | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(layout, ...) in x's dtype, for at most GEMV_MAX_M rows of x.

    `layout` must be the GPTQ order (gemv_reason). `blocks` (BLOCK_N, BLOCK_K, num_warps, SPLIT_K)
    overrides gemv_blocks (tuning runs); `variant` overrides GEMV_VARIANT.
    """
    k = x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    reason = gemv_reason(layout, m, None) if m > 0 else "no rows"
    assert reason is None, f"w4a16_gemv: {reason}"
    variant = variant or gemv_variant()
    if variant == "mma":
        from pagedllm.plugins.quantization.w4a16 import mma as mma

        if mma.usable(layout, flat, scales, qweight, n):
            return mma.w4a16_mma_gemv(x, layout, qweight, qzeros, scales, n)
        variant = "mant"
    if variant != "base":
        from pagedllm.plugins.quantization.w4a16 import gemv_tiled as tiled  # it imports this module

        if tiled.tiled_reason(variant, layout, m) is None:
            return tiled.w4a16_gemv_tiled(x, layout, qweight, qzeros, scales, n, variant, blocks)
    block_n, block_k, warps, split = blocks or gemv_blocks(layout, m, n, k)
    assert layout.group_size % block_k == 0 and block_k % layout.pack_factor == 0, (block_k, layout)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # every split owns at least one step, so every partial is written
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n), split)](
        flat, qweight, qzeros, scales, out,
        n, k, k_per_split,
        flat.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), m * n, n,
        layout.mask,
        GROUP_SIZE=layout.group_size,
        BITS=layout.bits,
        ZERO_OFFSET=layout.zero_offset,
        ROWS=m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split, BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], n)
