"""A Triton FP8 W8A8 GEMM for small and mid-sized batches: y = (x_q @ W_q^T) * a[m] * s[n].

    x_q [M, K] e4m3, a [M] float32      the activations quantized per token (or a static scale), fp8/kernel.py
    W_q [N, K] e4m3, s [N] float32      the weights and their row scales, as the FP8 method keeps them
    y   [M, N] in x's dtype             float32 accumulation (wgmma's FP8 mode on sm_90), both scales in the epilogue

Why not torch._scaled_mm at these sizes: cuBLASLt runs one 128 x 128 tile for row-wise scales at every M on
the H200, so a 4096-column output gets 32 blocks for 132 SMs and a batch of 4-64 rows pays for 128. On the
8B shapes (examples/gpu/fp8_w8a8_probe.py, 2026-12-03, quantization included on both sides) this kernel is
1.35-1.62x the quantize + _scaled_mm route per decoder layer at 4-64 rows; from 256 rows cuBLASLt's tile is
full and it wins (gate_up at 128 already).

NOTE 1 (tiles, fp8_gemm_blocks): the rows are the small side of the tile. SWAP computes y^T = W @ x^T so the
weight tile is wgmma's 64-row side and 16-64 activation rows its N side (CUTLASS's swap-AB for small M):
BLOCK_M = 16 up to 16 rows, else 64; BLOCK_N 64, BLOCK_K 256 (32 bytes of K per lane a load). A wide output
(at least 2 x SMs column tiles of 64: gate_up) takes the unswapped 64 x 128 x 128 tile, which the probe found
best for it at every M. Long reductions (K >= 8192: down_proj) of up to 16 rows split K until the grid has
about one program per SM (the probe's best at 4-16 rows; at 64 rows one slice was); partial sums meet in
a zeroed float32 buffer by atomics (summation order, so the last bits, may vary).
NOTE 2 (when, use_fp8_gemm): M <= 64, or M <= 128 while cuBLASLt's 128 x 128 grid would fill under half
the SMs; N a multiple of 64 and K of 256 (no masks along N or K). The method runs it on sm_90+ only (what
was measured); Ada's FP8 products stay on torch._scaled_mm.
NOTE 3: CUDA-graph safe: static shapes, no host sync; the split-K buffer comes from the caching allocator.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import sm_count

FP8_GEMM_MAX_M = 128  # NOTE 2


class Fp8GemmBlocks(NamedTuple):
    swap: int
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int = 4
    stages: int = 4


@triton.jit
def _fp8_gemm_kernel(xq_ptr, a_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                     SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # both operands K-major, as wgmma's FP8 mode requires
        if SWAP:
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])  # [BN, BK]
            x = tl.load(xq_ptr + offs_m[None, :] * K + offs_k[:, None], mask=m_ok[None, :], other=0.0)  # [BK, BM]
            acc += tl.dot(w, x)
        else:
            x = tl.load(xq_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
            w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None])  # [BK, BN]
            acc += tl.dot(x, w)
    a = tl.load(a_ptr + offs_m, mask=m_ok, other=0.0)
    s = tl.load(s_ptr + offs_n)
    if SWAP:
        acc = acc * s[:, None] * a[None, :]
        out = y_ptr + offs_m[None, :] * N + offs_n[:, None]
        ok = m_ok[None, :]
    else:
        acc = acc * a[:, None] * s[None, :]
        out = y_ptr + offs_m[:, None] * N + offs_n[None, :]
        ok = m_ok[:, None]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)


def use_fp8_gemm(m: int, n: int, k: int, sms: int) -> bool:
    """Whether an [m, k] x [k, n] FP8 product runs this kernel rather than torch._scaled_mm (NOTE 2)."""
    if m < 1 or n % 64 or k % 256:
        return False
    return m <= 64 or (m <= FP8_GEMM_MAX_M and triton.cdiv(m, 128) * triton.cdiv(n, 128) < sms // 2)


def fp8_gemm_blocks(m: int, n: int, k: int, sms: int) -> Fp8GemmBlocks:
    """The tile for an [m, k] x [k, n] product on a GPU with `sms` SMs (NOTE 1)."""
    if n // 64 >= 2 * sms and n % 128 == 0:
        return Fp8GemmBlocks(0, 64, 128, 128, 1)
    block_m = 16 if m <= 16 else 64
    programs = triton.cdiv(m, block_m) * (n // 64)
    split = 1
    while m <= 16 and k >= 8192 and programs * split * 2 <= sms and split < 4 and k % (256 * split * 2) == 0:
        split *= 2
    return Fp8GemmBlocks(1, block_m, 64, 256, split)


def fp8_gemm(x_q: torch.Tensor, a: torch.Tensor, w_q: torch.Tensor, row_scale: torch.Tensor, out_dtype: torch.dtype,
             blocks: Fp8GemmBlocks | None = None) -> torch.Tensor:
    """y [M, N] = (x_q @ w_q^T) * a * row_scale in `out_dtype`; x_q [M, K] and w_q [N, K] e4m3, a [M] or [M, 1]
    and row_scale [N] float32, on the tile `blocks` (default: fp8_gemm_blocks for this device)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if blocks is None:
        blocks = fp8_gemm_blocks(m, n, k, sm_count(x_q.device.index) if x_q.is_cuda else 132)
    swap, bm, bn, bk, split, warps, stages = blocks
    if split == 1:
        y = torch.empty(m, n, device=x_q.device, dtype=out_dtype)
    else:
        y = torch.zeros(m, n, device=x_q.device, dtype=torch.float32)
    grid = (triton.cdiv(m, bm), n // bn, split)
    _fp8_gemm_kernel[grid](x_q, a.reshape(-1), w_q, row_scale, y, m, n, k, k // split, SWAP=swap, BLOCK_M=bm,
                           BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return y if split == 1 else y.to(out_dtype)
