"""Tensor comparisons that fail with a message a plugin author can act on."""

from __future__ import annotations

import torch

# Default (rtol, atol) per compute dtype: float32 kernels agree to a few ulps of accumulated rounding; 16-bit
# ones round their inputs and probabilities (fp16: 2^-11, bf16: 2^-8 relative per element).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (5e-3, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


def tolerance(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """(rtol, atol) for `dtype`, each overridden when given."""
    default_rtol, default_atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def assert_close(got: torch.Tensor, ref: torch.Tensor, *, rtol: float, atol: float, what: str) -> float:
    """Raise AssertionError unless max|got - ref| <= atol + rtol * max|ref| (and shapes match, got is finite).

    The bound is on the largest error against the largest reference value, not element by element: a kernel
    whose tiny outputs carry relative noise passes, one off by a constant factor anywhere does not.
    Returns max|got - ref| / max|ref| (for reports).
    """
    if tuple(got.shape) != tuple(ref.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    g, r = got.detach().float().cpu(), ref.detach().float().cpu()
    bad = ~torch.isfinite(g)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite values (first at index {first})")
    diff = (g - r).abs()
    scale = float(r.abs().max()) if r.numel() else 0.0
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst > atol + rtol * scale:
        index = tuple(int(i) for i in (diff == worst).nonzero()[0])
        raise AssertionError(
            f"{what}: max |got - expected| = {worst:.3g} at index {index} (got {float(g[index]):.6g}, expected "
            f"{float(r[index]):.6g}); allowed {atol:g} + {rtol:g} * max|expected| ({scale:.3g}) = "
            f"{atol + rtol * scale:.3g}"
        )
    return worst / scale if scale else worst
