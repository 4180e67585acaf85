"""A W4A16 decode GEMV over a K-major repack of GPTQ weights: whole rows per program, as the dense GEMV.

Experimental (issue 7, docs/perf-notes.md §12): off unless PAGEDLLM_W4A16_KMAJOR=1 (w4a16_method.py), until
the H200 has measured it. The GPTQ layout keeps N
contiguous ([K / 8, N] words), so a decode GEMV must split K across programs to fill the GPU and sum partials
(w4a16_gemv_tiled.py: 53.9 us per Llama-8B layer on the H200, 1.0-1.6 TB/s on qkv / o). The dense 16-bit GEMV
(layers/dense_gemv_kernel.py) reads W [N, K] with K contiguous, so a program covers whole rows, warps lie along
K, and it streams the same shapes at 3.3-4.4 TB/s with no split. This kernel is that structure for 4-bit codes:

    repack_kmajor (once, at load)   qweight [K / 8, N] -> qw_t [N, K / 8] (word j of row n: inputs 8j..8j+7,
                                    low nibble first, as GPTQ packs along K); scales -> s_t [N, G];
                                    zero points (GPTQ v1 offset applied) -> z_t [N, G] in the scales' dtype
    grid (cdiv(N, BLOCK_N), SPLIT)  program (n block, K slice); BLOCK_K = 1024 x warps inputs per step
    per step                        words [BLOCK_N, C, 4]: each thread one 16-byte load per row (4 words = 32
                                    inputs, a quarter of a 128-group, so one scale and zero per row)
    per code                        w4a16_gemv_tiled NOTE 2's mantissa trick: 0.5 shift + LOP3 + FFMA
    per (row, 32 inputs)            acc += s * (256 (P - X_even - X_odd / 16) - z (X_even + X_odd))
    end                             one cross-lane sum per row; split > 1: layers/split_k.py's partials

More than KMAJOR_MAX_M rows (prefill, batched decode): `kmajor_matmul` dequantizes W [N, K] into a 16-bit
scratch (one Triton pass, K contiguous on both sides) and cuBLAS multiplies, as w4a16_dequant.py does from 128
rows of the GPTQ layout; the in-register GEMM for 9-127 rows has no K-major form (those steps pay the
dequantization: the experiment is about single-stream decode).

Registers stay low (BLOCK_N x 4 words, 32 inputs, BLOCK_N accumulators), so many programs fit an SM and their
16-byte loads keep bytes in flight, as in the dense kernel. Group sizes that are a multiple of 32; no act-order
(g_idx) -- sort_act_order's sorted groups would be, but that path is not wired here.
Under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 activations give exact math.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.layers.split_k import reduce_split, split_k, store_rows
from pagedllm.plugins.quantization.w4a16_gemv import GemvBlocks
from pagedllm.plugins.quantization.w4a16_layout import PackedLayout, unpack_codes

KMAJOR_MAX_M = 4
# Read once: the interpreter must be chosen before triton is imported, so it cannot change after this import.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def repack_kmajor(
    layout: PackedLayout, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ 4-bit tensors -> (qw_t [N, K / 8] int32, s_t [N, G], z_t [N, G]) for w4a16_gemv_kmajor."""
    if layout.kind != "gptq" or layout.bits != 4 or layout.group_size % 32:
        raise ValueError(f"kmajor GEMV: GPTQ 4-bit with groups of a multiple of 32 only, not {layout}")
    _, z = unpack_codes(layout, qweight[:1], qzeros)  # zero points with the v1 offset; codes not needed
    return qweight.t().contiguous(), scales.t().contiguous(), z.to(scales.dtype).t().contiguous()


@triton.jit
def _mant_pair(words, pair: tl.constexpr, lo_mask, hi_mask, one_lo, one_hi):
    """Codes 2 pair and 2 pair + 1 of every word as 1 + q / 256 and 1 / 16 + q / 256 (w4a16_gemv_tiled NOTE 2)."""
    if pair < 2:  # noqa: SIM108 (a constexpr branch: one shift is emitted)
        ws = words << (15 - 8 * pair)
    else:
        ws = words >> (8 * pair - 15)
    vl = ((ws & lo_mask) | one_lo).to(tl.float32, bitcast=True)
    vh = ((ws & hi_mask) | one_hi).to(tl.float32, bitcast=True)
    return vl, vh


@triton.jit
def _row_step(acc, words, x_row_ptr, xo, s, z, lo_mask, hi_mask, one_lo, one_hi):
    """acc [BLOCK_N, C] + this step's sum over each thread's 32 inputs, for one activation row."""
    p = tl.zeros(words.shape, dtype=tl.float32)
    x_even = tl.zeros(xo.shape, dtype=tl.float32)
    x_odd = tl.zeros(xo.shape, dtype=tl.float32)
    for pair in tl.static_range(4):
        vl, vh = _mant_pair(words, pair, lo_mask, hi_mask, one_lo, one_hi)
        x0 = tl.load(x_row_ptr + xo + 2 * pair).to(tl.float32)  # [C, 4]: input 8 word + 2 pair of the chunk
        x1 = tl.load(x_row_ptr + xo + 2 * pair + 1).to(tl.float32)
        p += x0[None, :, :] * vl + x1[None, :, :] * vh
        x_even += x0
        x_odd += x1
    xe = tl.sum(x_even, axis=1)  # [C]: one chunk's 32 inputs are one thread's, so these sums stay in registers
    xd = tl.sum(x_odd, axis=1)
    return acc + s * (256.0 * (tl.sum(p, axis=2) - (xe + xd * 0.0625)[None, :]) - z * (xe + xd)[None, :])


@triton.jit
def _w4a16_gemv_kmajor_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, part_ptr, ticket_ptr,
    N, K, K_PER_SPLIT, SPLITS,
    stride_xm, stride_qw, stride_s, stride_ym,
    lo_mask, hi_mask, one_lo, one_hi,
    GROUP_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    FUSED_SPLIT: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // 32  # 32-input chunks per step: one 16-byte load (4 words) per row and thread
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_c = tl.arange(0, C)
    offs_w = tl.arange(0, 4)
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    rows_qw = qw_ptr + offs_n.to(tl.int64)[:, None, None] * stride_qw
    a0 = tl.zeros((BLOCK_N, C), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    for k0 in range(k_begin, k_end, BLOCK_K):
        chunk = k0 // 32 + offs_c  # [C]
        word = (4 * chunk)[:, None] + offs_w[None, :]  # [C, 4]
        g = (chunk * 32) // GROUP_SIZE
        if EVEN:
            words = tl.load(rows_qw + word[None, :, :], eviction_policy="evict_first")
            s = tl.load(s_ptr + offs_n[:, None] * stride_s + g[None, :]).to(tl.float32)
            z = tl.load(z_ptr + offs_n[:, None] * stride_s + g[None, :]).to(tl.float32)
        else:
            c_ok = chunk * 32 < k_end
            m3 = n_ok[:, None, None] & c_ok[None, :, None] & (offs_w >= 0)[None, None, :]
            words = tl.load(rows_qw + word[None, :, :], mask=m3, other=0, eviction_policy="evict_first")
            m2 = n_ok[:, None] & c_ok[None, :]
            # masked chunks: s = 0 adds nothing whatever the codes and inputs were
            s = tl.load(s_ptr + offs_n[:, None] * stride_s + g[None, :], mask=m2, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + offs_n[:, None] * stride_s + g[None, :], mask=m2, other=0.0).to(tl.float32)
        xo = 8 * word  # [C, 4]: the first input of each word; its codes are inputs xo .. xo + 7
        if not EVEN:
            xo = tl.minimum(xo, K - 8)  # masked chunks read some real input (their s is 0)
        a0 = _row_step(a0, words, x_ptr, xo, s, z, lo_mask, hi_mask, one_lo, one_hi)
        if ROWS > 1:
            a1 = _row_step(a1, words, x_ptr + stride_xm, xo, s, z, lo_mask, hi_mask, one_lo, one_hi)
        if ROWS > 2:
            a2 = _row_step(a2, words, x_ptr + 2 * stride_xm, xo, s, z, lo_mask, hi_mask, one_lo, one_hi)
        if ROWS > 3:
            a3 = _row_step(a3, words, x_ptr + 3 * stride_xm, xo, s, z, lo_mask, hi_mask, one_lo, one_hi)
    p0 = tl.sum(a0, axis=1)
    p1 = tl.sum(a1, axis=1)
    p2 = tl.sum(a2, axis=1)
    p3 = tl.sum(a3, axis=1)
    if not FUSED_SPLIT:
        store_rows(y_ptr + offs_n, stride_ym, p0, p1, p2, p3, n_ok, ROWS)
    else:  # layers/split_k.py
        last, t0, t1, t2, t3 = reduce_split(part_ptr, ticket_ptr, pid_n, pid_k, offs_n, n_ok, N, SPLITS,
                                          p0, p1, p2, p3, ROWS, BLOCK_N)
        if last:
            store_rows(y_ptr + offs_n, stride_ym, t0, t1, t2, t3, n_ok, ROWS)


def kmajor_blocks(m: int, n: int, k: int) -> GemvBlocks:
    """The starting point a sweep refines: 4 rows per program at M = 1 (2 beyond), 4 warps along K
    (BLOCK_K 4096 = 1024 per warp), no split where N / BLOCK_N already gives ~8 programs per SM."""
    # Under the interpreter (CPU tests) every program is a Python loop: few, wide programs.
    block_n = 64 if _INTERPRETING else 4 if m == 1 else 2
    warps = 4
    while warps > 1 and 1024 * warps > k:
        warps //= 2
    block_k = min(1024 * warps, max(32, triton.next_power_of_2(k)))  # small K (tests): no masked-out steps
    col_blocks = triton.cdiv(n, block_n)
    split = 1 if col_blocks >= 1056 else max(1, min(triton.cdiv(1056, col_blocks), k // block_k))
    return GemvBlocks(block_n, block_k, warps, split)


def w4a16_gemv_kmajor(
    x: torch.Tensor,
    layout: PackedLayout,
    qw_t: torch.Tensor,
    s_t: torch.Tensor,
    z_t: torch.Tensor,
    blocks: GemvBlocks | tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(W)^T from repack_kmajor's tensors, for <= KMAJOR_MAX_M rows.

    `blocks` (BLOCK_N, BLOCK_K, num_warps, SPLIT_K) overrides kmajor_blocks (sweeps)."""
    k = x.shape[-1]
    n = qw_t.shape[0]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    assert 1 <= m <= KMAJOR_MAX_M and qw_t.shape[1] * 8 == k and k % 32 == 0, (m, k, tuple(qw_t.shape))
    assert layout.group_size % 32 == 0 and s_t.stride() == z_t.stride(), layout
    block_n, block_k, warps, split = blocks or kmajor_blocks(m, n, k)
    # 1024 x warps inputs per step give each thread one 16-byte load per row (module docstring); the kernel is
    # right for any power-of-two multiple of 32 (the interpreter tests use small steps)
    assert block_k % 32 == 0 and block_k & (block_k - 1) == 0, blocks
    sk = split_k(x, m, n, k, block_k, split, block_n)
    _w4a16_gemv_kmajor_kernel[(sk.col_blocks, sk.split)](
        flat, qw_t, s_t, z_t, sk.y, sk.part, sk.tickets,
        n, k, sk.per_split, sk.split,
        flat.stride(0), qw_t.stride(0), s_t.stride(0), n,
        0xF << 15, 0xF << 19, 0x3F800000, 0x3D800000,  # w4a16_gemv_tiled NOTE 2: masks as arguments
        GROUP_SIZE=layout.group_size,
        ROWS=m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=n % block_n == 0 and sk.per_split % block_k == 0 and k % sk.per_split == 0,
        FUSED_SPLIT=sk.split > 1,
        num_warps=warps,
    )
    return sk.y.reshape(*x.shape[:-1], n)


@triton.jit
def _kmajor_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qw, stride_s, stride_w,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """W [N, K] = (q - z) * s in w's dtype, the product rounded once (as dequantize() rounds)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    ok = n_ok[:, None] & (offs_k < K)[None, :]
    words = tl.load(qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qw + (offs_k // 8)[None, :], mask=ok, other=0)
    q = (words >> ((offs_k % 8) * 4)[None, :]) & 0xF
    g = offs_k // GROUP_SIZE
    s = tl.load(s_ptr + offs_n[:, None] * stride_s + g[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs_n[:, None] * stride_s + g[None, :], mask=ok, other=0.0).to(tl.float32)
    w = (q.to(tl.float32) - z) * s
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=ok)


def kmajor_dequantize(
    layout: PackedLayout, qw_t: torch.Tensor, s_t: torch.Tensor, z_t: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """W [N, K] in `dtype` from repack_kmajor's tensors (a per-call scratch from the caching allocator)."""
    n, k = qw_t.shape[0], qw_t.shape[1] * 8
    w = torch.empty(n, k, dtype=dtype, device=qw_t.device)
    block_n, block_k = 64 if _INTERPRETING else 16, min(256, max(32, triton.next_power_of_2(k)))
    _kmajor_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qw_t, s_t, z_t, w, n, k, qw_t.stride(0), s_t.stride(0), w.stride(0),
        GROUP_SIZE=layout.group_size, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return w


def kmajor_matmul(
    x: torch.Tensor, layout: PackedLayout, qw_t: torch.Tensor, s_t: torch.Tensor, z_t: torch.Tensor
) -> torch.Tensor:
    """y = x @ W^T from repack_kmajor's tensors: the GEMV up to KMAJOR_MAX_M rows, else dequantize + cuBLAS."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 1 <= m <= KMAJOR_MAX_M:
        return w4a16_gemv_kmajor(x, layout, qw_t, s_t, z_t)
    return F.linear(x, kmajor_dequantize(layout, qw_t, s_t, z_t, x.dtype))
