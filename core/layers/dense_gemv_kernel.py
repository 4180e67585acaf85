"""A Triton GEMV for dense weights at decode sizes: y[M, N] = x[M, K] @ W[N, K]^T (+ b), M <= 4.

W is 16-bit (the activations' dtype), or e4m3 FP8 with one float32 scale per output row (NOTE 7).

Decode reads each weight once and does two FLOPs with it, so the product is a stream: the kernel's one job is
to keep enough bytes in flight to read W at the HBM's read bandwidth (cuBLAS runs these shapes at ~3.7 TB/s
on the H200, docs/perf-notes.md §5c; the copy anchor 4.26 TB/s counts a read and a write).

    grid (cdiv(N, BLOCK_N), SPLIT_K)       program (n block, K slice of K_PER_SPLIT inputs)
    per step (BLOCK_K inputs)              W tile [BLOCK_N, BLOCK_K] in one 2-D load (K contiguous: one
                                           16-byte load per thread and row), x[m, k0:k0+BLOCK_K]
                                           acc_m[BLOCK_N, BLOCK_K / 8] += sum of 8 adjacent w * x_m
    end of the slice                       p_m = sum of acc_m over K (one cross-lane reduction per program)
    SPLIT_K = 1                            y[m, n] = p_m (+ b), rounded once to the output dtype
    SPLIT_K > 1                            partial[split, m, n] = p_m (float32); the program that draws its
                                           n block's last ticket sums the partials in a fixed order (NOTE 2)

NOTE 1 (layouts and registers; checked by compiling for sm_90 on the CPU, docs/perf-notes.md §11): BLOCK_K is
8 x 32 x num_warps, so every warp lies along K and a thread owns 8 adjacent inputs of each of the tile's
BLOCK_N rows. Then x's 1-D load has the layout of the tile's columns (no conversion through shared memory,
no barrier in the loop: a BLOCK_K of 512 with 4 warps put two BAR.SYNC in every step), and the 8 products of
one 16-byte load are summed in registers before they meet the accumulator, which is [BLOCK_N, BLOCK_K / 8]:
48 registers at M = 1 (8 x 1024, 4 warps) against 106 for a [BLOCK_N, BLOCK_K] one, so ~10 programs fit
an SM and their loads hide the latency (ptxas issues 3-4 of a step's 8 loads before the first is used, so
bytes in flight come from resident warps, not from one program's tile). One reduction across lanes and
warps per program, at the end. Every sum's order is fixed by the compiled code: the bits are the same every
run and differ from cuBLAS's only by summation order (both accumulate in float32 and round once).
NOTE 2 (split-K in one launch, layers/split_k.py, shared with the W4A16 and GGUF GEMVs): each program stores its float32 partials,
`debug_barrier` (every thread's stores before the ticket), then one atomic_add (acq_rel, gpu scope) on its n
block's ticket; the program that draws SPLIT_K - 1 reads the partials through L2 (`.cg`) in a fixed order, so y
is deterministic, adds the bias, writes y and puts the ticket back to 0 (the buffer stays zero between
launches: CUDA-graph safe). No second kernel per linear: at decode a launch inside a graph costs ~1-2 us,
as much as the o projection's whole tail. The tickets are one int32 buffer per device, allocated on first
use (the engine's eager warm-up runs before any capture); GEMVs on two streams at once would share them --
the engine's decode is one stream.
NOTE 3 (EVEN): when BLOCK_N divides N and BLOCK_K divides K (every Llama-8B shape) the loads carry no mask,
so Triton keeps them 16 bytes wide; odd shapes take masked loads (correct, slower).
NOTE 4: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
NOTE 5 (GATED: SiLU-and-mul folded into the down projection): at decode the MLP's activation is its own
launch (~1.5-2 us in a graph, once per layer) that writes 14,336 values the down GEMV reads straight back.
GATED reads [gate | up] instead and forms silu(gate) * up per input as the fused kernel does (triton_ops
act_and_mul: the activation rounded to the dtype before the multiply, the product rounded once), so the
values that meet the weights are the ones the two-launch path would have stored. Each thread computes its
own 8 inputs per step (warps lie along K: no input is computed twice in a program).
NOTE 7 (FP8 weights, W8A16): the FP8 linear method's decode products. W [N, K] float8_e4m3fn is widened to
float32 in registers as it is loaded (exact: every e4m3 value is a float32 value) and multiplies the 16-bit
activations as 16-bit weights do; the row's scale multiplies the float32 sum once, before the bias and the one
rounding to the output dtype: y = (sum_k W_q[n, k] x[k]) s[n] (+ b). A step reads half the bytes of bf16 and
the activations are not quantized (the W8A8 path rounds them to e4m3 per token for torch._scaled_mm). Triton
keeps the weight loads 16 bytes wide (16 e4m3 values per thread where the tile has them: the sm_90 PTX of
BLOCK_K 2048 at 8 warps holds two ld.global.v4.b32 per thread and row pair), and the block rule (dense_gemv.py)
sizes the tiles from 1-byte weights.
NOTE 6 (PDL, layers/pdl.py): launched with programmatic dependent launch on sm_90+, each program lets the
next kernel start, prefetches its first step's rows of W into L2, and only then waits for the kernel before
it (whose output is x); every load of x or the bias and every store comes after the wait. Off by default
(pdl.PDL_KERNELS): in the engine it made bf16 W3 slower on the H200 (PAGEDLLM_PDL=dense turns it on).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch
from pagedllm.layers.dense_gemv import GEMV_MAX_M, DenseGemvBlocks
from pagedllm.layers.pdl import launch_dependents, pdl_on, prefetch_l2, wait_primary
from pagedllm.layers.split_k import reduce_split, split_k


@triton.jit
def _load_x(x_ptr, kk, k_ok, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + kk).to(tl.float32)
    else:
        return tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit
def _fma_row(acc, x_ptr, row: tl.constexpr, stride_xm, K, kk, k_ok, w, EVEN: tl.constexpr,
             GATED: tl.constexpr, dtype: tl.constexpr):
    """acc + w * x[row, kk] (broadcast over the tile's rows), in float32; GATED: x = silu(gate) * up (NOTE 5)."""
    if GATED:
        gate = _load_x(x_ptr + row * stride_xm, kk, k_ok, EVEN)
        up = _load_x(x_ptr + row * stride_xm + K, kk, k_ok, EVEN)
        act = gate / (1.0 + tl.exp(-gate))
        x = (act.to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
    else:
        x = _load_x(x_ptr + row * stride_xm, kk, k_ok, EVEN)
    prod = w * x[None, :]
    # NOTE 1: each thread's 8 adjacent inputs (one 16-byte load) are summed in registers, no shuffles
    return acc + tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // 8, 8)), axis=2)


@triton.jit
def _finish_rows(y_ptr, stride_ym, b_ptr, s_ptr, offs_n, n_ok, p0, p1, p2, p3, ROWS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr):
    """y[m, offs_n] = p_m (x s) (+ b), one rounding to y's dtype (ROW_SCALE: FP8 weights, NOTE 7)."""
    if ROW_SCALE:
        s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        p0 *= s
        p1 *= s
        p2 *= s
        p3 *= s
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        p0 += b
        p1 += b
        p2 += b
        p3 += b
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, p0.to(dtype), mask=n_ok)
    if ROWS > 1:
        tl.store(y_ptr + stride_ym + offs_n, p1.to(dtype), mask=n_ok)
    if ROWS > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, p2.to(dtype), mask=n_ok)
    if ROWS > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, p3.to(dtype), mask=n_ok)


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, ticket_ptr,
    N, K, K_PER_SPLIT, SPLITS,
    stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    FUSED_SPLIT: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    n_ok = offs_n < N
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # int64: N x K may pass 2^31 (an LM head)
    if PDL:  # NOTE 6: the first step's rows head for L2 while the kernel before this one finishes
        launch_dependents(PDL)
        LINES: tl.constexpr = BLOCK_K // 64 if BLOCK_K >= 64 else 1  # 64 16-bit weights per 128-byte line
        rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
        prefetch_l2(rows + tl.minimum(k_begin + 64 * tl.arange(0, LINES), K - 1)[None, :])
        wait_primary(PDL)
    a0 = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)  # NOTE 1
    a1, a2, a3 = a0, a0, a0
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_end
        if EVEN:  # NOTE 3
            w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        w = w.to(tl.float32)
        a0 = _fma_row(a0, x_ptr, 0, stride_xm, K, kk, k_ok, w, EVEN, GATED, dtype)
        if ROWS > 1:
            a1 = _fma_row(a1, x_ptr, 1, stride_xm, K, kk, k_ok, w, EVEN, GATED, dtype)
        if ROWS > 2:
            a2 = _fma_row(a2, x_ptr, 2, stride_xm, K, kk, k_ok, w, EVEN, GATED, dtype)
        if ROWS > 3:
            a3 = _fma_row(a3, x_ptr, 3, stride_xm, K, kk, k_ok, w, EVEN, GATED, dtype)
    p0 = tl.sum(a0, axis=1)  # NOTE 1: one reduction per program
    p1 = tl.sum(a1, axis=1) if ROWS > 1 else p0
    p2 = tl.sum(a2, axis=1) if ROWS > 2 else p0
    p3 = tl.sum(a3, axis=1) if ROWS > 3 else p0
    if not FUSED_SPLIT:
        _finish_rows(y_ptr, stride_ym, b_ptr, s_ptr, offs_n, n_ok, p0, p1, p2, p3, ROWS, HAS_BIAS, ROW_SCALE)
    else:  # NOTE 2
        last, t0, t1, t2, t3 = reduce_split(part_ptr, ticket_ptr, pid_n, pid_k, offs_n, n_ok, N, SPLITS,
                                          p0, p1, p2, p3, ROWS, BLOCK_N)
        if last:
            _finish_rows(y_ptr, stride_ym, b_ptr, s_ptr, offs_n, n_ok, t0, t1, t2, t3, ROWS, HAS_BIAS, ROW_SCALE)


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: DenseGemvBlocks | tuple[int, int, int, int],
    gated: bool = False,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight[N, K]^T (+ bias) for at most GEMV_MAX_M rows of x; y in x's dtype.

    gated: x is [..., 2K] = [gate | up] and the product takes silu(gate) * up, rounded as SiluAndMul rounds
    (NOTE 5), without writing it out. row_scale: weight is float8_e4m3fn and row_scale [N] float32 its
    per-row scales (NOTE 7).
    """
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    n = weight.shape[0]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    assert 1 <= m <= GEMV_MAX_M and weight.shape[1] == k and weight.stride(1) == 1, (m, tuple(weight.shape))
    block_n, block_k, warps, split = blocks
    assert block_k % 8 == 0 and split >= 1, blocks  # 8 adjacent inputs are summed per thread (NOTE 1)
    assert (row_scale is not None) == (weight.dtype == torch.float8_e4m3fn), (weight.dtype, row_scale is None)
    sk = split_k(x, m, n, k, block_k, split, block_n)
    y = sk.y
    pdl = pdl_on(flat, "dense")
    launch(
        _dense_gemv_kernel, (sk.col_blocks, sk.split),
        flat, weight, bias if bias is not None else y, row_scale if row_scale is not None else y, y, sk.part,
        sk.tickets,
        n, k, sk.per_split, sk.split,
        flat.stride(0), weight.stride(0), n,
        ROWS=m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0,
        HAS_BIAS=bias is not None,
        ROW_SCALE=row_scale is not None,
        FUSED_SPLIT=sk.split > 1,
        GATED=gated,
        PDL=pdl,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y.reshape(*x.shape[:-1], n)
