"""When a dense [gate | up] layer runs the gated GEMM (gated_gemm_kernel.py): act(gate) * up in its epilogue.

    the layer's switch on        `gated_gemm` on its method (method.py), from the engine config's
                                 `gated_gemm` at construction (PAGEDLLM_GATED_GEMM=true; off by default: on the H200 its
                                 best config ran 0.94x of cuBLAS + act_and_mul, perf-notes §18b)
    x on CUDA, sm_90+, triton    TMA descriptors; the CPU and older GPUs keep cuBLAS + act_and_mul
    x and W one 16-bit dtype     no bias; W [2I, K] contiguous, x rows contiguous and 16-byte aligned
    rows M >= GATED_GEMM_MIN_M   prompt-sized steps (decode steps stay in their CUDA graphs on cuBLAS, or on
                                 the decode GEMV)
    I % BN == 0, K % 8 == 0      the gate and up halves split on a tile boundary; TMA's 16-byte row pitch

This module imports no triton: the kernel module is imported on the first call that takes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.api.kernels import triton_available

GATED_GEMM_MIN_M = 2048
ACTIVATIONS = ("silu", "gelu_tanh")


class GatedGemmConfig(NamedTuple):
    """One launch configuration of the kernel (examples/gpu/gated_gemm_sweep.py sweeps them)."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    persistent: bool = False  # gated_gemm_kernel NOTE 3
    warp_specialize: bool = False  # gated_gemm_kernel NOTE 4 (plain kernel only)


# The fastest of examples/gpu/gated_gemm_sweep.py's 13 configs on the H200 (Triton 3.6) at 2,048-16,384 rows: 608
# TFLOP/s at 16,384 against cuBLAS's 689 for the GEMM alone (650 with act_and_mul after it), so 0.94x; the
# 128 x 128 tiles with two accumulators (cuBLAS's 128 x 256 shape) ran 0.83-0.86x, persistent variants no better.
DEFAULT_CONFIG = GatedGemmConfig(bm=128, bn=64, bk=64, num_warps=4, num_stages=4)


def unusable_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> str | None:
    """Why this call cannot take the gated GEMM (None: it can)."""
    cfg = DEFAULT_CONFIG
    if activation not in ACTIVATIONS:
        return f"activation {activation!r}"
    if bias is not None:
        return "bias"
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows < GATED_GEMM_MIN_M:  # first of the shape checks: decode steps (most calls) stop here
        return f"{rows} rows < {GATED_GEMM_MIN_M}"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (9, 0):
        return "needs CUDA sm_90+ (TMA)"
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return f"dtypes {x.dtype} / {weight.dtype}"
    if weight.dim() != 2 or weight.shape[1] != k or weight.shape[0] % 2 or (weight.shape[0] // 2) % cfg.bn:
        return f"weight {tuple(weight.shape)} is not [gate | up] halves of a multiple of {cfg.bn} rows"
    if k % 8 or not weight.is_contiguous() or not x.is_contiguous() or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return "layout (K % 8, contiguous, 16-byte aligned)"
    return None


def maybe_gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str) -> torch.Tensor | None:
    """act(x @ W_gate^T) * (x @ W_up^T) from the gated GEMM when usable, else None (the caller has checked
    the layer's switch)."""
    if not triton_available() or unusable_reason(x, weight, bias, activation) is not None:
        return None
    from pagedllm.plugins.quantization.unquantized.gated_gemm_kernel import gated_gemm

    k = x.shape[-1]
    out = gated_gemm(x.reshape(-1, k), weight, activation)
    return out.view(*x.shape[:-1], out.shape[-1])
