"""RMSNorm, optionally fused with the residual add that precedes it in every pre-norm decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.fused_ops import FusedOp, cpu_ops_of, use_fused


class RMSNorm(FusedOp, nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in float32 and cast back (as transformers does).

    On CUDA one Triton kernel does the residual add, the norm and the weight (core/layers/triton_ops.py);
    on the CPU, for models that switched them on, one C call (cpu_ops.c); the torch code below is the
    reference.
    """

    # Gemma scales by (1 + weight) in float32; set by GemmaRMSNorm.
    gemma: bool = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward(x) -> norm(x); forward(x, residual) -> (norm(x + residual), x + residual).

        The fused form lets a decoder layer carry the un-normalised stream as `residual` without a separate
        add kernel; the first layer passes residual=None via `forward(x)` and keeps x as its residual.
        """
        ops = cpu_ops_of(self)  # fused_ops.py NOTE 3: C kernels on float32 CPU tensors, for this model only
        if ops is not None and x.dtype == torch.float32 and (residual is None or residual.dtype == torch.float32):
            out, new_residual = ops.add_rms_norm(x, residual, self.weight, self.eps, self.gemma)
            return out if new_residual is None else (out, new_residual)
        # The kernel keeps one dtype end to end; a mixed call (an fp32 residual stream) takes the torch path.
        same_dtype = self.weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
        if same_dtype and use_fused(self, x):
            from pagedllm.layers.triton_ops import rms_norm

            out, new_residual = rms_norm(x, self.weight, self.eps, residual, gemma=self.gemma)
            return out if new_residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, cast back once.

    The checkpoint stores weight as the offset from 1, so a fresh layer starts from zeros.
    """

    gemma = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
