"""A Triton GEMM for packed integer weights (AWQ GEMM and GPTQ layouts) with 16-bit activations.

    y[M, N] = x[M, K] @ W^T[K, N],   W^T[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]

Each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps: it loads the packed words of a
[BLOCK_K, BLOCK_N] tile of q (GPTQ: K/pf rows of words; AWQ: N/8 columns of words), shifts and masks them into
codes, looks up each input's group (g_idx for GPTQ act-order, k // group_size otherwise) to fetch the zero
and scale, dequantizes in registers and accumulates tl.dot in float32. The dequantized tile never reaches
memory, so a decode step reads 4 bits per weight instead of 16.

NOTE 1: block sizes follow M. Decode (M < 64) is bound by reading the weight: 64-wide N tiles, long K
steps, and K split over several programs (SPLIT_K) until about twelve programs per SM are in flight, or a
narrow layer (o_proj, down_proj: N = 4096) would leave most SMs idle. Prefill is bound by the dot: square
64x64 tiles, no split. The numbers come from the H200 runs in docs/benchmarks.md (quant_bench.py), not an
autotuner (autotuning under the CPU interpreter would take minutes).
NOTE 2: a packed word is loaded once and broadcast to the pf codes it holds (reshape of a broadcast), not
gathered once per code; with no act-order the step lies inside one group, so zeros and scales are one row.
NOTE 3: with SPLIT_K > 1 the programs of one tile add float32 partial sums atomically into a zeroed buffer,
cast to the activation dtype afterwards (summation order, so the last bits, may vary run to run).
NOTE 4: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
NOTE 5: w4a16_matmul picks the kernel by rows:

    M <= GEMV_MAX_M (8)          the GEMV, w4a16/gemv.py: this GEMM pads M to 16 rows for tl.dot and reads far
                                 below the 4-bit stream's bandwidth there (docs/benchmarks.md)
    8 < M <= 16, 4-bit           the tensor-core GEMV (w4a16/mma.py) once per 8 rows where it runs: on the
                                 H200 an 8B layer at 16 rows is 97.8 us against this GEMM's 181.9 (its tile
                                 pads to 16 rows; examples/gpu/w4_mma_check.py, docs/benchmarks.md tenth pass)
    8 < M < DEQUANT_MIN_M (64)   this GEMM
    M >= DEQUANT_MIN_M           dequantize into a 16-bit scratch + cuBLAS, w4a16/dequant.py: at 64 rows this
                                 GEMM takes 1.4x its time per 8B layer, and a variant tuned for 256-2048 rows
                                 (examples/gpu/w4_gemm_probe.py) 1.1-2.4x (the unpacking competes with tl.dot)
NOTE 6 (wide layers): a layer of at least 128 x SMs output columns (gate_up of an 8B model: 28672) keeps this
GEMM up to WIDE_GEMM_MAX_M rows with a larger tile (64 x 128 x 128 at 64 rows, 128 x 128 x 64 and four stages
above): its scratch is the most expensive to write (235 MB at 8B). On the H200 (2026-12-03) its product took
113 / 137 / 146 us at 64 / 96 / 128 rows against dequantize + cuBLAS's 142 / 142 / 187, and lost at 256
(the probe's best 186 against 171).
NOTE 7 (the tensor-core GEMM, w4a16/mma_gemm.py): 4-bit GPTQ order without act-order from MMA_ROWS_MAX_M + 1
to MMA_GEMM_MAX_M rows, and to MMA_GEMM_LARGE_MAX_M on a layer of at least 2^25 weights, where the scratch of
dequantize + cuBLAS costs most against the GEMM's work. On the H200 (2026-12-03, 8B layers; examples/gpu/
w4_mma_gemm_check.py) it took 24 / 20 / 59 / 40 us for qkv / o / gate_up / down at 64 rows against the old
route's 30 / 20 / 113 / 77, and 105 / 67 against 138 / 79 for gate_up / down at 128 rows (qkv and o there: 35 /
27 against 34 / 24); from 256 rows its mma.sync rate (~300 TFLOP/s against cuBLAS's wgmma at ~680) loses to
dequantize + cuBLAS on every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import sm_count
from pagedllm.plugins.quantization.w4a16.dequant import DEQUANT_MIN_M, w4a16_dequant_matmul
from pagedllm.plugins.quantization.w4a16.gemv import gemv_reason, w4a16_gemv
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

MMA_ROWS_MAX_M = 16  # up to here 4-bit products take the tensor-core GEMV in 8-row slices (NOTE 5)
MMA_GEMM_MAX_M = 64  # up to here the rest take the tensor-core GEMM (NOTE 7) ...
MMA_GEMM_LARGE_MAX_M = 128  # ... and up to here those of a layer of at least MMA_GEMM_LARGE_WEIGHTS weights
MMA_GEMM_LARGE_WEIGHTS = 1 << 25
WIDE_GEMM_MAX_M = 128  # up to here a wide layer's products stay on this GEMM (NOTE 6)
_SMS = 132  # an H100 / H200, where no device is at hand (route tables printed on the CPU)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_qw, stride_qz, stride_s, stride_ym,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    AWQ: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if AWQ:
        # output n sits in word n // 8, nibble (n % 2) * 4 + (n % 8) // 2 (AWQ_ORDER's inverse)
        j = offs_n % 8
        col_word = offs_n // 8
        col_shift = ((j % 2) * 4 + j // 2) * 4
        offs_nw = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    else:
        col_word = offs_n // PF
        col_shift = (offs_n % PF) * BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # NOTE 2: each packed word is loaded once and broadcast to the codes it holds.
        if AWQ:
            wmask = k_ok[:, None] & (offs_nw < N // 8)[None, :]
            words = tl.load(qw_ptr + offs_k[:, None] * stride_qw + offs_nw[None, :], mask=wmask, other=0)
            words = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_K, BLOCK_N // 8, 8)), (BLOCK_K, BLOCK_N))
            q = (words >> col_shift[None, :]) & MASK
        else:
            offs_kw = k0 // PF + tl.arange(0, BLOCK_K // PF)
            wmask = (offs_kw < K // PF)[:, None] & n_ok[None, :]
            words = tl.load(qw_ptr + offs_kw[:, None] * stride_qw + offs_n[None, :], mask=wmask, other=0)
            words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // PF, PF, BLOCK_N)), (BLOCK_K, BLOCK_N))
            q = (words >> ((offs_k % PF) * BITS)[:, None]) & MASK
        if HAS_G_IDX:  # act-order: every input has its own group, gathered per element
            g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            kn_ok = k_ok[:, None] & n_ok[None, :]
            zw = tl.load(qz_ptr + g[:, None] * stride_qz + col_word[None, :], mask=kn_ok, other=0)
            z = ((zw >> col_shift[None, :]) & MASK) + ZERO_OFFSET
            s = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=kn_ok, other=0.0)
            w = ((q - z).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        else:  # BLOCK_K divides the group size: one group, one row of zeros and scales per step
            g = k0 // GROUP_SIZE
            zw = tl.load(qz_ptr + g * stride_qz + col_word, mask=n_ok, other=0)
            z = ((zw >> col_shift) & MASK) + ZERO_OFFSET
            s = tl.load(s_ptr + g * stride_s + offs_n, mask=n_ok, other=0.0)
            w = ((q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]).to(x.dtype)
        acc += tl.dot(x, w)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:  # NOTE 3: partial sums of K slices meet in a float32 buffer
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def _blocks(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, SPLIT_K, num_stages) for an [m, k] x [k, n] product (NOTE 1, 6)."""
    if m <= 16:
        block_m, block_n, block_k, warps = 16, 64, 128, 4
    elif m < DEQUANT_MIN_M:
        block_m, block_n, block_k, warps = 32, 64, 128, 4
    elif m <= DEQUANT_MIN_M:  # NOTE 6: a wide layer at the dequantizing path's rows
        return 64, 128, 128, 4, 1, 3
    elif m <= WIDE_GEMM_MAX_M:
        return 128, 128, 64, 4, 1, 4
    else:
        return 64, 64, 64, 4, 1, 3
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles), _MAX_SPLIT, k // (4 * block_k)))
    return block_m, block_n, block_k, warps, split, 3


# About twelve programs per SM of an H100 / H200 (132 SMs), at most 8 slices of K: this gives the H200
# sweep's best splits at M = 1 -- 8 for qkv / o / down (N = 6144 / 4096), 4 for gate_up (N = 28672).
_TARGET_PROGRAMS = 1584
_MAX_SPLIT = 8


def w4a16_gemm(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    n: int,
    blocks: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(layout, ...) in x's dtype, dequantized inside the kernel.

    `blocks` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, SPLIT_K[, num_stages]) overrides the table of NOTE 1
    (tuning runs).
    """
    k = x.shape[-1]
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, split, stages = (*blocks, 3)[:6] if blocks else _blocks(m, n, k)
    if g_idx is None:
        block_k = min(block_k, layout.group_size)
        if layout.group_size % block_k:  # a K step would straddle two groups: look groups up per input
            g_idx = torch.arange(k, device=x.device, dtype=torch.int32) // layout.group_size
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else (
        torch.zeros(m, n, dtype=torch.float32, device=x.device)
    )
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _w4a16_gemm_kernel[grid](
        flat, qweight, qzeros, scales, g_idx if g_idx is not None else qzeros, y,
        m, n, k, k_per_split,
        flat.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), y.stride(0),
        GROUP_SIZE=layout.group_size,
        BITS=layout.bits,
        AWQ=layout.kind == "awq",
        HAS_G_IDX=g_idx is not None,
        ZERO_OFFSET=layout.zero_offset,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        num_warps=warps,
        num_stages=stages,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def w4a16_matmul(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """y = x @ dequantize(...): the GEMV for decode-sized inputs, dequantize + cuBLAS for large ones, the
    tensor-core GEMM or the Triton GEMM between (NOTE 5, 7)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    sms = sm_count(x.device.index) if x.is_cuda else _SMS
    route = w4a16_route(layout, m, g_idx, n, sms, k)
    if route == "mma_gemm":
        from pagedllm.plugins.quantization.w4a16 import mma_gemm as mma_gemm

        if x.is_cuda and mma_gemm.usable(layout, x, scales, qweight, n):
            return mma_gemm.w4a16_mma_gemm(x, layout, qweight, qzeros, scales, n)
        route = _triton_or_dequant(layout, m, g_idx, n, sms)
    if route == "gemv":
        return w4a16_gemv(x, layout, qweight, qzeros, scales, n)
    if route == "mma_rows":
        from pagedllm.plugins.quantization.w4a16 import mma as mma

        if x.is_cuda and mma.usable(layout, x.reshape(-1, x.shape[-1])[: mma.MMA_MAX_M], scales, qweight, n):
            return mma.w4a16_mma_rows(x, layout, qweight, qzeros, scales, n)
        return w4a16_gemm(x, layout, qweight, qzeros, scales, g_idx, n)
    if route == "dequant":
        return w4a16_dequant_matmul(x, layout, qweight, qzeros, scales, g_idx, n)
    return w4a16_gemm(x, layout, qweight, qzeros, scales, g_idx, n)


def w4a16_route(layout: PackedLayout, m: int, g_idx: torch.Tensor | None = None, n: int = 0, sms: int = _SMS,
                k: int = 0) -> str:
    """Which kernel w4a16_matmul runs for `m` rows of an [n, k] layer on `sms` SMs (NOTE 5, 6, 7): "gemv",
    "mma_rows" (the tensor-core GEMV on 8-row slices where it runs, else the GEMM), "mma_gemm" (the
    tensor-core GEMM where it runs, else the next route below), "gemm" or "dequant" (+ cuBLAS).

    Each is CUDA-graph safe: launches and caching-allocator tensors of static shapes, no host sync (the split-K
    tickets are allocated at the eager warm-up before capture and reset by the kernels themselves)."""
    if m > 0 and gemv_reason(layout, m, g_idx) is None:
        return "gemv"
    four_bit_gptq = g_idx is None and layout.kind == "gptq" and layout.bits == 4
    if m <= MMA_ROWS_MAX_M and four_bit_gptq:
        return "mma_rows"
    if four_bit_gptq and (m <= MMA_GEMM_MAX_M or (m <= MMA_GEMM_LARGE_MAX_M and n * k >= MMA_GEMM_LARGE_WEIGHTS)):
        return "mma_gemm"  # NOTE 7
    return _triton_or_dequant(layout, m, g_idx, n, sms)


def _triton_or_dequant(layout: PackedLayout, m: int, g_idx: torch.Tensor | None, n: int, sms: int) -> str:
    """The route without the tensor-core GEMM (NOTE 5, 6): where it does not run, or past its rows."""
    if (m <= WIDE_GEMM_MAX_M and g_idx is None and layout.kind == "gptq" and layout.bits == 4
            and n // 128 >= sms):
        return "gemm"  # NOTE 6
    return "dequant" if m >= DEQUANT_MIN_M else "gemm"
