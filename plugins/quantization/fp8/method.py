"""The FP8 linear method: e4m3 weights with one float32 scale per output row, W8A8 where the GPU has it.

    weight      [N, K] float8_e4m3fn        (on the fly: loaded in the model dtype, quantized after loading)
    row scale   [N] float32                 per-tensor scales of fused pieces are expanded to their rows
    input scale scalar float32 (static)     the largest of the fused pieces' scales, as the pieces share x

    apply, CUDA with compute capability >= 8.9, at most 2 rows (decode):
        y = (x @ W_q^T) * row scale in one Triton GEMV that widens W_q in registers (W8A16: x stays 16-bit;
        pagedllm.api.kernels.dense_gemv, core/layers/dense_gemv_kernel.py NOTE 7): a decode step reads the
        1-byte weights once, without the activation-quantization launch before each product
    apply, CUDA with compute capability >= 8.9 and activations quantized, more rows:
        x_q = fp8(x / a),  y = (x_q @ W_q^T) * a [M, 1] * row scale [1, N]: on sm_90+ up to 64 rows (128 for
        narrow layers) a Triton GEMM whose tile follows M (fp8/gemm.py), else torch._scaled_mm (cuBLASLt)
        a = per-token max|x| / 448 (dynamic) or the static input scale; x_q and a in one Triton pass
        (fp8/kernel.py), bit-identical to quantize_activations_torch
    apply, anywhere else (CPU, Ampere, weight-only checkpoints):
        y = x @ (W_q * row scale)^T, dequantized per call: weights stay 1 byte, activations unquantized (W8A16)
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.api.kernels import gemv_blocks, sm_count
from pagedllm.api.model import WeightLoadError, set_weight_attrs

logger = logging.getLogger("pagedllm")

# $PAGEDLLM_FP8_TRITON_GEMM=0 sends every quantized-activation product to torch._scaled_mm (A/B runs).
_TRITON_GEMM = os.environ.get("PAGEDLLM_FP8_TRITON_GEMM", "1") != "0"


@functools.cache
def _triton_gemm_sms(index: int) -> int:
    """The SM count fp8/gemm.py's rule sizes its grid by, or 0 where it does not run: only sm_90+ was measured
    (wgmma's FP8 mode); Ada's FP8 products stay on torch._scaled_mm."""
    return sm_count(index) if _TRITON_GEMM and torch.cuda.get_device_capability(index)[0] >= 9 else 0

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token would divide by zero


@dataclass(frozen=True)
class Fp8Scheme:
    """What the checkpoint holds: fp8 weights (or float, quantized on load), weight-scale granularity, and
    how activations are scaled ("static", "dynamic", or None for weight-only)."""

    checkpoint_fp8: bool
    weight_strategy: str  # "tensor" | "channel"
    activations: str | None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (fp8 W / s, s [N]) with s = max|row| / 448: every row uses the full e4m3 range."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations_torch(
    flat: torch.Tensor, static: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 x / a, a [M, 1] float32): a = max|row| / 448 per token, or the static scale.

    The reference semantics; fp8_kernel.quantize_per_token computes the same bits in one pass.
    """
    if static is not None:
        a = static.reshape(1, 1).float().expand(flat.shape[0], 1).contiguous()
    else:
        a = (flat.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (flat.float() / a).clamp(-FP8_MAX, FP8_MAX).to(FP8), a


def quantize_activations(flat: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations_torch's result; on CUDA by the fused Triton kernel (one read of x, not ~5 passes)."""
    if not flat.is_cuda:
        return quantize_activations_torch(flat, static)
    from pagedllm.plugins.quantization.fp8.kernel import quantize_per_token

    return quantize_per_token(flat if flat.stride(-1) == 1 else flat.contiguous(), static)


def scaled_mm_reason(device: torch.device, k: int, n: int) -> str | None:
    """Why torch._scaled_mm cannot run this layer here (None: it can)."""
    if device.type != "cuda":
        return f"device {device.type} has no FP8 matmul"
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        return f"compute capability {cc[0]}.{cc[1]} < 8.9 has no FP8 matmul"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    if k % 16 or n % 16:
        return f"shape [{n}, {k}] is not a multiple of 16"
    return None


class Fp8LinearMethod:
    """QuantizationMethod for FP8 layers (one per layer; the scheme comes from its config)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        dtype = FP8 if self.scheme.checkpoint_fp8 else params_dtype
        weight = nn.Parameter(torch.empty(n, k, dtype=dtype), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("weight", weight)
        if not self.scheme.checkpoint_fp8:
            return
        pieces = len(output_partition_sizes)
        if self.scheme.weight_strategy == "channel":
            scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"output_dim": 0})
        else:
            scale = self._per_piece_scalar(layer, pieces)
        layer.register_parameter("weight_scale", scale)
        if self.scheme.activations == "static":
            layer.register_parameter("input_scale", self._per_piece_scalar(layer, pieces))

    @staticmethod
    def _per_piece_scalar(layer: nn.Module, pieces: int) -> nn.Parameter:
        """One float32 per fused piece; each checkpoint scalar goes to the piece its shard id names."""
        param = nn.Parameter(torch.full((pieces,), float("nan")), requires_grad=False)

        def load(p: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if loaded.numel() != 1:
                raise WeightLoadError(f"expected a per-tensor scale (one value), got shape {tuple(loaded.shape)}")
            piece = int(layer.piece_index(shard_id))  # type: ignore[operator]
            p.data[piece] = loaded.reshape(()).float()

        set_weight_attrs(param, {"method_loads": True, "weight_loader": load})
        return param

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        sizes = cast(list[int], layer.output_partition_sizes)
        if self.scheme.checkpoint_fp8:
            scale = cast(torch.Tensor, layer.weight_scale).data
            if scale.dim() == 2:  # per channel [N, 1]
                row_scale = scale.reshape(-1)
            else:  # per tensor, one per fused piece
                row_scale = scale.repeat_interleave(torch.tensor(sizes, device=scale.device))
            q = weight.data
        else:
            q, row_scale = quantize_rows(weight.data)
            layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
        layer.register_buffer("fp8_row_scale", row_scale.float().contiguous())
        input_scale = getattr(layer, "input_scale", None)
        if input_scale is not None:
            layer.register_buffer("fp8_input_scale", input_scale.data.max().reshape(1, 1).float())
        reason = "activations are not quantized (weight-only FP8)" if self.scheme.activations is None else (
            scaled_mm_reason(q.device, q.shape[1], q.shape[0])
        )
        layer.__dict__["fp8_scaled_mm"] = reason is None
        if reason is not None and q.device.type == "cuda":
            logger.info("fp8: dequantizing per matmul (W8A16) because %s", reason)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = cast(torch.Tensor, layer.weight)
        row_scale = cast(torch.Tensor, layer.fp8_row_scale)
        blocks = gemv_blocks(x, weight, bias)  # None off CUDA, above 2 rows, before sm_89
        if blocks is not None:
            from pagedllm.api.kernels import dense_gemv

            return dense_gemv(x, weight, bias, blocks, row_scale=row_scale)
        if not layer.__dict__["fp8_scaled_mm"]:
            w = weight.to(torch.float32) * row_scale.unsqueeze(1)
            return F.linear(x, w.to(x.dtype), bias)
        flat = x.reshape(-1, x.shape[-1])
        static = cast(torch.Tensor | None, getattr(layer, "fp8_input_scale", None))
        x_q, a = quantize_activations(flat, static)
        m, (n, k) = flat.shape[0], weight.shape
        from pagedllm.plugins.quantization.fp8.gemm import fp8_gemm, fp8_gemm_blocks, use_fp8_gemm

        sms = _triton_gemm_sms(x.device.index)
        if sms and use_fp8_gemm(m, n, k, sms):
            y = fp8_gemm(x_q, a, weight, row_scale, x.dtype, fp8_gemm_blocks(m, n, k, sms))
        else:
            # Row-wise scales need a bfloat16 output (cuBLASLt); the model dtype is restored after.
            y = torch._scaled_mm(x_q, weight.t(), scale_a=a, scale_b=row_scale.unsqueeze(0), out_dtype=torch.bfloat16)
            y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
