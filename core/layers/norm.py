"""RMSNorm, optionally fused with the residual add that precedes it in every pre-norm decoder layer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in float32 and cast back (as transformers does)."""

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
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
