"""act(x @ W_gate^T) * (x @ W_up^T) in one Triton kernel: a [gate | up] GEMM with SiLU-and-mul in its epilogue.

Imported on the first call (it imports triton); gated_gemm.py decides when it runs.

One program computes a [BM, BN] tile of the [M, I] output: per K step it loads the activation tile once
(TMA, [BM, BK]) and two weight tiles -- rows off_n.. of the gate half and I + off_n.. (HALF) of the up half of the
[2I, K] weight as nn.Linear stores it, so no repacking -- and keeps two fp32 accumulators on the tensor cores.
Per tile that is a [BM, 2 * BN] GEMM tile's work, reading the same bytes as cuBLAS's gate_up GEMM, but the
[M, 2I] gate_up product is never written and read back: at W1's 16,384 rows that round trip (940 MB written
by the GEMM, read by act_and_mul, plus act_and_mul's launch) is ~0.33 ms per layer, 2.7 % of a prompt step
(perf-notes §16e). Whether that pays depends on the main loop keeping up with cuBLAS (~700 TFLOP/s here).

NOTE 1 (rounding): the unfused path rounds each GEMM output to the model dtype, then computes act(gate) in
float32, rounds it, and multiplies by up (triton_ops.act_and_mul NOTE 1). The epilogue rounds at the same
places, so the only difference left is the GEMM's summation order.

NOTE 2 (grouped tile order): consecutive programs walk GROUP_M row tiles of one column band before moving on,
so a band of weight tiles is re-read from L2 by GROUP_M programs instead of from HBM.

NOTE 3 (persistent variant, config `persistent`): with two 128 x 128 fp32 accumulators a program holds ~193
registers a thread at 8 warps, so one program per SM, and a one-tile program's epilogue (rounding, the
activation, the TMA store) leaves the tensor cores idle. The persistent kernel runs one program per SM over
many tiles, its tile and K loops flattened (Triton's tl.range(flatten=True)), so the pipeliner issues the next
tile's loads during the epilogue -- how Triton's Hopper matmul tutorial hides part of it. Which wins is the
sweep's question (examples/gpu/gated_gemm_sweep.py).

NOTE 4 (warp specialization, config `warp_specialize`): cuBLAS's Hopper GEMMs give the TMA loads a producer
warp and the wgmma a consumer warpgroup (or two, ping-pong) with their own registers; a plain Triton loop
issues both from every warp, and the sweep measured the best such config at 0.94x cuBLAS + act_and_mul
(perf-notes §18b). Triton >= 3.5 partitions a `tl.range(..., warp_specialize=True)` loop the same way on
Hopper (Meta's autoWS); offline, Triton 3.9 builds it for sm_90 at 128 x 128 x 64 with 8 warps and rejects
4-warp tiles. Not with the persistent kernel: flattened loops and warp specialization do not combine there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import sm_count
from pagedllm.plugins.quantization.unquantized.gated_gemm import DEFAULT_CONFIG, GatedGemmConfig


@triton.jit
def _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of the tile_id-th program in the grouped order (NOTE 2)."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile_id // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % group_rows, (tile_id % per_group) // group_rows


@triton.jit
def _gate_up_tile(a_desc, w_desc, off_m, off_n, HALF, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  WARP_SPECIALIZE: tl.constexpr = False):
    """The tile's two fp32 accumulators: x[off_m.., :] against the gate rows off_n.. and the up rows HALF + off_n..;
    each activation tile is loaded once for both dots."""
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(tl.cdiv(K, BK), warp_specialize=WARP_SPECIALIZE):  # NOTE 4
        a = a_desc.load([off_m, k * BK])
        acc_g = tl.dot(a, w_desc.load([off_n, k * BK]).T, acc_g)
        acc_u = tl.dot(a, w_desc.load([HALF + off_n, k * BK]).T, acc_u)
    return acc_g, acc_u


@triton.jit
def _gated_epilogue(acc_g, acc_u, c_desc, off_m, off_n, GELU_TANH: tl.constexpr):
    dtype = c_desc.dtype
    gate = acc_g.to(dtype).to(tl.float32)  # NOTE 1: the GEMM's outputs, rounded as the unfused path stores them
    up = acc_u.to(dtype).to(tl.float32)
    if GELU_TANH:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    c_desc.store([off_m, off_n], (act.to(dtype).to(tl.float32) * up).to(dtype))


@triton.jit
def _gated_gemm_kernel(
    a_desc, w_desc, c_desc, M, HALF, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, GELU_TANH: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(HALF, BN), GROUP_M)
    acc_g, acc_u = _gate_up_tile(a_desc, w_desc, pid_m * BM, pid_n * BN, HALF, K, BM, BN, BK, WARP_SPECIALIZE)
    _gated_epilogue(acc_g, acc_u, c_desc, pid_m * BM, pid_n * BN, GELU_TANH)


@triton.jit
def _gated_gemm_persistent_kernel(
    a_desc, w_desc, c_desc, M, HALF, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, GELU_TANH: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """NOTE 3: one program per SM walks tiles NUM_PROGRAMS apart; the tile and K loops are flattened into one
    software pipeline, so the next tile's first loads are in flight during this tile's epilogue."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(HALF, BN)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc_g, acc_u = _gate_up_tile(a_desc, w_desc, pid_m * BM, pid_n * BN, HALF, K, BM, BN, BK)
        _gated_epilogue(acc_g, acc_u, c_desc, pid_m * BM, pid_n * BN, GELU_TANH)


_GELU = {"silu": False, "gelu_tanh": True}


def gated_gemm(x: torch.Tensor, weight: torch.Tensor, activation: str = "silu",
               config: GatedGemmConfig | None = None) -> torch.Tensor:
    """act(x @ weight[:I]^T) * (x @ weight[I:]^T) for x [M, K] and weight [2I, K] (both row-major, one dtype);
    returns [M, I]. The caller (gated_gemm.py) has checked the shapes the kernel needs: I % BN == 0, K % 8 == 0."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = config or DEFAULT_CONFIG
    m, k = x.shape
    i = weight.shape[0] // 2
    out = torch.empty(m, i, dtype=x.dtype, device=x.device)
    a_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.bm, cfg.bk])
    w_desc = TensorDescriptor(weight, [2 * i, k], [weight.stride(0), 1], [cfg.bn, cfg.bk])
    c_desc = TensorDescriptor(out, [m, i], [out.stride(0), 1], [cfg.bm, cfg.bn])
    tiles = triton.cdiv(m, cfg.bm) * (i // cfg.bn)
    meta = dict(BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, GELU_TANH=_GELU[activation],
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.persistent:
        programs = min(tiles, sm_count(x.device.index or 0) if x.is_cuda else 3)  # 3: interpreter runs walk tiles
        _gated_gemm_persistent_kernel[(programs,)](a_desc, w_desc, c_desc, m, i, k, NUM_PROGRAMS=programs, **meta)
    else:
        _gated_gemm_kernel[(tiles,)](a_desc, w_desc, c_desc, m, i, k, WARP_SPECIALIZE=cfg.warp_specialize, **meta)
    return out
