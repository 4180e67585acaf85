"""Decode GEMV variants for GPTQ-ordered packed weights: word tiles in flight, split-K summed in the kernel.

Same product and layout as w4a16/gemv.py (y[M, N] = x[M, K] @ W^T[K, N], qweight [K / pf, N] int32), for
M <= TILED_MAX_M. The H200 ran the first GEMV at 0.9-1.8 TB/s of weight (docs/perf-notes.md §5a); these
variants go after the three causes found by compiling for sm_90 on the CPU:

    variant        words per thread in flight      dequantization per code             split-K sum
    base           (w4a16/gemv.py) ptxas' choice   SHF, LOP3, FADD (exp), FFMA         second kernel
    tile           BLOCK_K / pf  (one 2-D load)    SHF, LOP3, FADD (exp), FFMA         last program
    tile_pf        2 x BLOCK_K / pf (next step     as tile                             last program
                   loaded before this one's math)
    mant           BLOCK_K / pf                    SHF / 2, LOP3, FFMA (4-bit only)    last program
    mant_pf        2 x BLOCK_K / pf                as mant                             last program

    grid (cdiv(N, BLOCK_N), SPLIT_K)     program (n block, K slice), BLOCK_N / (32 x warps) columns per thread
    per step (one group)                 words [BLOCK_K / pf, BLOCK_N] in one load: every row is its own
                                         16-byte load per thread, all issued before the first is used
    per code j (unrolled)                p_m[n] += sum over word rows r of x[m, k0 + r pf + j] * w[r, n]
    split > 1                            partial[split, m, n] (float32); an int32 ticket per n block: the
                                         program that draws SPLIT_K - 1 sums the partials in split order,
                                         writes y and puts the ticket back to 0

NOTE 1 (bytes in flight): a decode GEMV is latency bound unless each SM keeps ~20-40 KB of loads
outstanding (4 TB/s x ~1 us / 132 SMs). One tl.load of a [BLOCK_K / pf, BLOCK_N] tile compiles to that many
independent LDG.128 per thread, issued back to back; the *_pf variants also issue the next step's tile (and
its zeros and scales) before this step's math, so a program never waits on a load it just issued.
NOTE 2 (mant: fewer instructions per code, 4-bit only): OR-ing a code into the top of a float's mantissa
builds the float without an int->float convert or a subtraction. One shift moves codes 2i and 2i + 1 to
bits 15..18 and 19..22; then, one LOP3 each,
    even code:  (ws & 0xF << 15) | bits of 1.0      = 1 + q / 256
    odd code:   (ws & 0xF << 19) | bits of 1/16     = 1/16 + q / 256        (the same weight on q)
so one [R, BLOCK_N] accumulator P = sum x v (one FFMA per code) gives, with X_even / X_odd the step's sums of
x over even / odd inputs (a vector over the lanes, reduced by shuffles once per step),
    sum x (q - z) = 256 (P - X_even - X_odd / 16) - z (X_even + X_odd).
The subtraction gives up 8 bits of float32 (q / 256 against 1): ~1e-6 of sum |x w| on the CPU tests, far
under bf16's 4e-3. Per code: 0.5 shift + LOP3 + FFMA, against shift + LOP3 + FADD + FFMA for the exponent
trick. The masks and exponents are kernel arguments: as immediates ptxas rematerialises them per use.
NOTE 3 (split-K in one kernel): each program stores its float32 partials, `debug_barrier` (every thread's
stores before the ticket), then one atomic_add (acq_rel, gpu scope) on its n block's ticket. The program
that draws the last ticket reads the partials through L2 (`.cg`), in a fixed order, so y has the same bits
every run; it resets the ticket, so the buffer stays zero between launches (CUDA-graph safe). The pieces
(partial sum, row stores, the per-device ticket buffer, the split sizing) are layers/split_k.py's, shared
with the dense and GGUF GEMVs.
NOTE 4: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
bf16 activations are read two per 32-bit load and widened with integer ops (X_BF16), which it runs exactly.
NOTE 5 (activations): x is read as scalars every lane loads alike (uniform, from L1): a per-step scalar
pointer x + k0 plus constant offsets, so each load is one LDG with an immediate offset (offsets built from a
tensor of inputs cost three 64-bit address instructions per load).
NOTE 6 (PDL, layers/pdl.py): launched with programmatic dependent launch on sm_90+, each program lets the
next kernel start, prefetches its first step's words, scales and zeros into L2, and only then waits for the
kernel before it (whose output is x); every load of x and every store comes after the wait.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import (
    launch_dependents,
    pdl_on,
    prefetch_l2,
    reduce_split,
    split_k,
    store_rows,
    wait_primary,
)
from pagedllm.plugins.quantization.w4a16.gemv import GemvBlocks, _as_biased_float
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

TILED_MAX_M = 4
# name -> (PREFETCH, MANT)
TILED_VARIANTS = {"tile": (False, False), "tile_pf": (True, False), "mant": (False, True),
                  "mant_pf": (True, True)}


@triton.jit
def _x_pair(x_step, xo, stride_xm, J: tl.constexpr, ROW: tl.constexpr, X_BF16: tl.constexpr):
    """x[ROW, k0 + r pf + J] and [.. + J + 1] as float32 [R] vectors every thread holds whole (uniform loads).

    x_step = x + k0 is a scalar pointer and xo = r pf a constant per register, so each load is one LDG with
    an immediate offset (NOTE 5); bf16 pairs come in one 32-bit load, widened by shift / mask.
    """
    if X_BF16:
        xw = tl.load(x_step.to(tl.pointer_type(tl.int32)) + ((ROW * stride_xm + J) // 2 + xo // 2))
        return (xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)
    else:
        x = x_step + ROW * stride_xm + J + xo
        return tl.load(x).to(tl.float32), tl.load(x + 1).to(tl.float32)


@triton.jit
def _fma_pair(p, x_step, xo, stride_xm, J: tl.constexpr, ROW: tl.constexpr, X_BF16: tl.constexpr, w0, w1):
    x0, x1 = _x_pair(x_step, xo, stride_xm, J, ROW, X_BF16)
    return p + x0[:, None] * w0 + x1[:, None] * w1


@triton.jit
def _step_exp(a0, a1, a2, a3, words, zb, s, x_step, stride_xm, xo, code_mask,
              BITS: tl.constexpr, ROWS: tl.constexpr, X_BF16: tl.constexpr):
    """One step with the exponent-trick codes (w4a16/gemv.py NOTE 1); codes j, j + 1 share an x load.

    The partial sums stay [R, BLOCK_N] (one FFMA per code and row) and are summed over R once per step
    (a tl.sum per code would compile to FMUL + FADD trees).
    """
    PF: tl.constexpr = 32 // BITS
    zero = tl.zeros(words.shape, dtype=tl.float32)
    p0, p1, p2, p3 = zero, zero, zero, zero
    for j in tl.static_range(0, PF, 2):
        w0 = _as_biased_float((words >> (j * BITS)) & code_mask) - zb[None, :]
        w1 = _as_biased_float((words >> ((j + 1) * BITS)) & code_mask) - zb[None, :]
        p0 = _fma_pair(p0, x_step, xo, stride_xm, j, 0, X_BF16, w0, w1)
        if ROWS > 1:
            p1 = _fma_pair(p1, x_step, xo, stride_xm, j, 1, X_BF16, w0, w1)
        if ROWS > 2:
            p2 = _fma_pair(p2, x_step, xo, stride_xm, j, 2, X_BF16, w0, w1)
        if ROWS > 3:
            p3 = _fma_pair(p3, x_step, xo, stride_xm, j, 3, X_BF16, w0, w1)
    return (a0 + tl.sum(p0, axis=0) * s, a1 + tl.sum(p1, axis=0) * s, a2 + tl.sum(p2, axis=0) * s,
            a3 + tl.sum(p3, axis=0) * s)


@triton.jit
def _x_sums(x_step, stride_xm, ROW: tl.constexpr, BLOCK_K: tl.constexpr, X_BF16: tl.constexpr):
    """Sums of x[ROW, k0 + even] and x[ROW, k0 + odd] over the step: a vector spread over the lanes, reduced
    by shuffles (cheaper than adding each thread's scalars: NOTE 2)."""
    half = tl.arange(0, BLOCK_K // 2)
    if X_BF16:
        xw = tl.load(x_step.to(tl.pointer_type(tl.int32)) + ROW * stride_xm // 2 + half)
        even = (xw << 16).to(tl.float32, bitcast=True)
        odd = (xw & -65536).to(tl.float32, bitcast=True)
    else:
        even = tl.load(x_step + ROW * stride_xm + 2 * half).to(tl.float32)
        odd = tl.load(x_step + ROW * stride_xm + 2 * half + 1).to(tl.float32)
    return tl.sum(even, axis=0), tl.sum(odd, axis=0)


@triton.jit
def _mant_finish(acc, p, x_step, stride_xm, z, s, ROW: tl.constexpr, BLOCK_K: tl.constexpr,
                 X_BF16: tl.constexpr):
    """acc + s * sum x (q - z) over the step, from the [R, BLOCK_N] sums p (NOTE 2)."""
    x_even, x_odd = _x_sums(x_step, stride_xm, ROW, BLOCK_K, X_BF16)
    return acc + (256.0 * (tl.sum(p, axis=0) - (x_even + x_odd * 0.0625)) - z * (x_even + x_odd)) * s


@triton.jit
def _step_mant(a0, a1, a2, a3, words, z, s, x_step, stride_xm, xo, lo_mask, hi_mask, one_lo, one_hi,
               ROWS: tl.constexpr, BLOCK_K: tl.constexpr, X_BF16: tl.constexpr):
    """One step of 4-bit codes placed in a float's mantissa (NOTE 2); z is the float zero point."""
    zero = tl.zeros(words.shape, dtype=tl.float32)
    p0, p1, p2, p3 = zero, zero, zero, zero
    for pair in tl.static_range(4):  # codes 2 pair, 2 pair + 1 (bits 8 pair ..) moved to bits 15 and 19
        if pair < 2:  # noqa: SIM108 (a constexpr branch: only one shift is emitted)
            ws = words << (15 - 8 * pair)
        else:
            ws = words >> (8 * pair - 15)
        # one LOP3 each (the masks and exponents are kernel arguments, so no constants are rematerialised):
        # even code: 1 + q / 256; odd code: (1 + q / 16) / 16 = 1 / 16 + q / 256 (same weight for q)
        vl = ((ws & lo_mask) | one_lo).to(tl.float32, bitcast=True)
        vh = ((ws & hi_mask) | one_hi).to(tl.float32, bitcast=True)
        p0 = _fma_pair(p0, x_step, xo, stride_xm, 2 * pair, 0, X_BF16, vl, vh)
        if ROWS > 1:
            p1 = _fma_pair(p1, x_step, xo, stride_xm, 2 * pair, 1, X_BF16, vl, vh)
        if ROWS > 2:
            p2 = _fma_pair(p2, x_step, xo, stride_xm, 2 * pair, 2, X_BF16, vl, vh)
        if ROWS > 3:
            p3 = _fma_pair(p3, x_step, xo, stride_xm, 2 * pair, 3, X_BF16, vl, vh)
    a0 = _mant_finish(a0, p0, x_step, stride_xm, z, s, 0, BLOCK_K, X_BF16)
    if ROWS > 1:
        a1 = _mant_finish(a1, p1, x_step, stride_xm, z, s, 1, BLOCK_K, X_BF16)
    if ROWS > 2:
        a2 = _mant_finish(a2, p2, x_step, stride_xm, z, s, 2, BLOCK_K, X_BF16)
    if ROWS > 3:
        a3 = _mant_finish(a3, p3, x_step, stride_xm, z, s, 3, BLOCK_K, X_BF16)
    return a0, a1, a2, a3


@triton.jit
def _load_step(qw_ptr, qz_ptr, s_ptr, k0, k_end, offs_n, n_ok, r_idx, z_word, z_shift, stride_qw, stride_qz,
               stride_s, GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The step at k0's words [R, BLOCK_N], raw zero words and scales; nothing (masked) when k0 >= k_end."""
    PF: tl.constexpr = 32 // BITS
    live = n_ok & (k0 + offs_n * 0 < k_end)  # [BLOCK_N]: the interpreter wants full-shape masks
    g = k0 // GROUP_SIZE
    rows = k0 // PF + r_idx
    words = tl.load(qw_ptr + rows[:, None] * stride_qw + offs_n[None, :],
                    mask=n_ok[None, :] & (rows < k_end // PF)[:, None], other=0, eviction_policy="evict_first")
    zw = tl.load(qz_ptr + g * stride_qz + z_word, mask=live, other=0)
    s = tl.load(s_ptr + g * stride_s + offs_n, mask=live, other=0.0).to(tl.float32)
    return words, (zw >> z_shift), s


@triton.jit
def _prefetch_first_step(qw_ptr, qz_ptr, s_ptr, k_begin, pid_n, N, K, r_idx, stride_qw, stride_qz, stride_s,
                         GROUP_SIZE: tl.constexpr, PF: tl.constexpr, BLOCK_N: tl.constexpr):
    """One prefetch per 128-byte line of the step's word rows, scales and zero words (addresses clamped in
    bounds: a prefetch is a hint, but the address must still be one of ours)."""
    WORD_LINES: tl.constexpr = BLOCK_N // 32 if BLOCK_N >= 32 else 1  # 32 int32 words per line
    SCALE_LINES: tl.constexpr = BLOCK_N // 64 if BLOCK_N >= 64 else 1  # 64 16-bit scales per line
    n0 = pid_n * BLOCK_N
    rows = tl.minimum(k_begin // PF + r_idx, K // PF - 1)
    cols = tl.minimum(n0 + 32 * tl.arange(0, WORD_LINES), N - 1)
    prefetch_l2(qw_ptr + rows[:, None] * stride_qw + cols[None, :])
    g = k_begin // GROUP_SIZE
    prefetch_l2(s_ptr + g * stride_s + tl.minimum(n0 + 64 * tl.arange(0, SCALE_LINES), N - 1))
    prefetch_l2(qz_ptr + g * stride_qz + tl.minimum(n0 // PF + tl.arange(0, 1), (N - 1) // PF))


@triton.jit
def _step(a0, a1, a2, a3, words, zcode, s, x_ptr, stride_xm, k0, r_idx, code_mask, lo_mask, hi_mask, one_lo,
          one_hi, BITS: tl.constexpr, ZERO_OFFSET: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
          MANT: tl.constexpr, X_BF16: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    zb = _as_biased_float((zcode & MASK) + ZERO_OFFSET)  # 2^23 + z
    x_step = x_ptr + k0
    xo = r_idx * PF
    if MANT:
        return _step_mant(a0, a1, a2, a3, words, zb - 8388608.0, s, x_step, stride_xm, xo, lo_mask, hi_mask,
                          one_lo, one_hi, ROWS, BLOCK_K, X_BF16)
    else:
        return _step_exp(a0, a1, a2, a3, words, zb, s, x_step, stride_xm, xo, code_mask, BITS, ROWS, X_BF16)


@triton.jit
def _w4a16_gemv_tiled_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, part_ptr, ticket_ptr,
    N, K, K_PER_SPLIT, SPLITS,
    stride_xm, stride_qw, stride_qz, stride_s, stride_ym,
    code_mask, lo_mask, hi_mask, one_lo, one_hi,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED_SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    MANT: tl.constexpr,
    X_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PF
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = tl.max_contiguous(tl.multiple_of(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), BLOCK_N), BLOCK_N)
    n_ok = offs_n < N
    r_idx = tl.arange(0, R)
    z_word = offs_n // PF
    z_shift = (offs_n % PF) * BITS
    a0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    if PDL:  # NOTE 6: the first step's weights head for L2 while the kernel before this one finishes
        launch_dependents(PDL)
        _prefetch_first_step(qw_ptr, qz_ptr, s_ptr, k_begin, pid_n, N, K, r_idx, stride_qw, stride_qz, stride_s,
                             GROUP_SIZE, PF, BLOCK_N)
        wait_primary(PDL)
    if PREFETCH:  # NOTE 1: the next step's loads are issued before this step's math
        words, zc, s = _load_step(qw_ptr, qz_ptr, s_ptr, k_begin, k_end, offs_n, n_ok, r_idx, z_word, z_shift,
                                  stride_qw, stride_qz, stride_s, GROUP_SIZE, BITS, BLOCK_K)
        for k0 in range(k_begin, k_end, BLOCK_K):
            words_n, zc_n, s_n = _load_step(qw_ptr, qz_ptr, s_ptr, k0 + BLOCK_K, k_end, offs_n, n_ok, r_idx,
                                            z_word, z_shift, stride_qw, stride_qz, stride_s,
                                            GROUP_SIZE, BITS, BLOCK_K)
            a0, a1, a2, a3 = _step(a0, a1, a2, a3, words, zc, s, x_ptr, stride_xm, k0, r_idx, code_mask,
                                   lo_mask, hi_mask, one_lo, one_hi, BITS, ZERO_OFFSET, ROWS, BLOCK_K,
                                   MANT, X_BF16)
            words, zc, s = words_n, zc_n, s_n
    else:
        for k0 in range(k_begin, k_end, BLOCK_K):
            words, zc, s = _load_step(qw_ptr, qz_ptr, s_ptr, k0, k_end, offs_n, n_ok, r_idx, z_word, z_shift,
                                      stride_qw, stride_qz, stride_s, GROUP_SIZE, BITS, BLOCK_K)
            a0, a1, a2, a3 = _step(a0, a1, a2, a3, words, zc, s, x_ptr, stride_xm, k0, r_idx, code_mask,
                                   lo_mask, hi_mask, one_lo, one_hi, BITS, ZERO_OFFSET, ROWS, BLOCK_K,
                                   MANT, X_BF16)
    if not FUSED_SPLIT:
        store_rows(y_ptr + offs_n, stride_ym, a0, a1, a2, a3, n_ok, ROWS)
    else:  # NOTE 3
        last, t0, t1, t2, t3 = reduce_split(part_ptr, ticket_ptr, pid_n, pid_k, offs_n, n_ok, N, SPLITS,
                                          a0, a1, a2, a3, ROWS, BLOCK_N)
        if last:
            store_rows(y_ptr + offs_n, stride_ym, t0, t1, t2, t3, n_ok, ROWS)


# One-warp programs: up to 32 resident per SM; about 12 per SM of 132 keeps every SM busy through the tail.
_TARGET_PROGRAMS = 1584
# M = 1 starting points (BLOCK_N, BLOCK_K), one warp: the sm_90 compile's best registers x instructions per code
# (docs/perf-notes.md §5c): 8 columns per thread halve the activation loads per code.
_M1_TILES = {"tile": (256, 64), "tile_pf": (128, 64), "mant": (256, 64), "mant_pf": (256, 64)}
# (variant, M, N, K) -> blocks: the H200 sweep's best per Llama-3.1-8B shape (`python examples/gpu/w4_gemv_sweep.py`,
# docs/benchmarks.md; split is the requested split-K). M = 1: 2026-11-30 00:20 UTC with the chunked split-K sum
# and PDL (53.9 us per layer); M = 2, 4: 2026-11-29 19:26 UTC. Other shapes use tiled_blocks' rule.
_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
_SWEPT = {
    ("mant", 1): {"qkv": (128, 128, 1, 32), "o": (128, 128, 1, 32), "gate_up": (256, 64, 1, 38), "down": (128, 128, 1, 33)},
    ("mant", 2): {"qkv": (128, 64, 1, 32), "o": (128, 64, 1, 32), "gate_up": (128, 64, 1, 8), "down": (128, 64, 1, 50)},
    ("mant", 4): {"qkv": (128, 32, 1, 33), "o": (128, 32, 1, 50), "gate_up": (128, 32, 1, 8), "down": (128, 32, 1, 50)},
}
TILED_TABLE: dict[tuple[str, int, int, int], GemvBlocks] = {
    (variant, m, *_SHAPES[shape]): GemvBlocks(*blocks)
    for (variant, m), per_shape in _SWEPT.items()
    for shape, blocks in per_shape.items()
}


def tiled_blocks(variant: str, layout: PackedLayout, m: int, n: int, k: int) -> GemvBlocks:
    """TILED_TABLE's entry, else a starting point per variant (the H200 sweep refines it per shape)."""
    if (variant, m, n, k) in TILED_TABLE:
        return TILED_TABLE[(variant, m, n, k)]
    block_n, block_k = _M1_TILES[variant] if m == 1 else (128, 64 if m == 2 else 32)
    block_k = max(math.gcd(block_k, layout.group_size), layout.pack_factor)
    col_blocks = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, col_blocks), k // (2 * block_k)))
    return GemvBlocks(block_n, block_k, 1, split)


def tiled_reason(variant: str, layout: PackedLayout, m: int) -> str | None:
    """Why this variant cannot take the product (None: it can); the caller falls back to the base GEMV."""
    if variant not in TILED_VARIANTS:
        return f"unknown variant {variant!r} (one of {sorted(TILED_VARIANTS)})"
    if m > TILED_MAX_M:
        return f"{m} rows > {TILED_MAX_M}"
    if TILED_VARIANTS[variant][1] and layout.bits != 4:
        return f"{variant} places 4-bit codes in the mantissa (NOTE 2); {layout.bits}-bit weights"
    return None


def w4a16_gemv_tiled(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    variant: str = "tile",
    blocks: GemvBlocks | tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(...) with one of TILED_VARIANTS (GPTQ order, <= TILED_MAX_M rows).

    `blocks` (BLOCK_N, BLOCK_K, num_warps, SPLIT_K) overrides tiled_blocks (tuning runs).
    """
    k = x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    reason = tiled_reason(variant, layout, m)
    assert reason is None and layout.kind == "gptq", f"w4a16_gemv_tiled: {reason or layout.kind}"
    block_n, block_k, warps, split = blocks or tiled_blocks(variant, layout, m, n, k)
    assert layout.group_size % block_k == 0 and block_k % layout.pack_factor == 0, (block_k, layout)
    sk = split_k(x, m, n, k, block_k, split, block_n)
    y = sk.y
    prefetch, mant = TILED_VARIANTS[variant]
    pdl = pdl_on(flat, "w4a16")
    _w4a16_gemv_tiled_kernel[(sk.col_blocks, sk.split)](
        flat, qweight, qzeros, scales, y, sk.part, sk.tickets,
        n, k, sk.per_split, sk.split,
        flat.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), n,
        layout.mask, 0xF << 15, 0xF << 19, 0x3F800000, 0x3D800000,  # NOTE 2: masks as arguments, not immediates
        GROUP_SIZE=layout.group_size,
        BITS=layout.bits,
        ZERO_OFFSET=layout.zero_offset,
        ROWS=m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FUSED_SPLIT=sk.split > 1,
        PREFETCH=prefetch,
        MANT=mant,
        X_BF16=flat.dtype == torch.bfloat16 and flat.stride(0) % 2 == 0 and flat.data_ptr() % 4 == 0,
        PDL=pdl,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y.reshape(*x.shape[:-1], n)
