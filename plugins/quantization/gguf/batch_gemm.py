"""The bf16 copy of a GGUF matrix that NativeKernel's large products (>= COPY_GEMM_ROWS rows) multiply by.

NOTE 1: the copy is kept in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
torch.compile's CPU backend packs linear weights into) where this torch build has oneDNN's bf16 linear. A plain
[N, K] bf16 weight handed to `F.linear` is re-packed by oneDNN on every call, which at a prompt's row counts
costs about as much as the product: SmolLM2's four matrices of a layer at 32 rows ran 0.33 ms packed against
0.58 ms plain on one core of an AVX512-BF16 EPYC (2026-12-02, interleaved in one process); from ~256 rows on
the repack is amortised and both run alike. The outputs are the same bits (the same oneDNN kernel, only the
weight's copy is skipped). Elsewhere the plain copy and `F.linear`.
NOTE 2: where bf16_gemm.c builds (AVX512-BF16), the copy is kept in its panels instead and every product runs
there: at SmolLM2's shapes it ran 1.35-2.0x the packed oneDNN GEMM at 16-64 rows, 1.1-1.25x at 128 and
0.96-1.12x at 512-2048 (2 threads, 30 copies of each matrix cycled so the weights arrive from memory, Zen 4,
2026-12-04), and it answers float32 directly (oneDNN's bf16 linear rounds its outputs to bf16, which the
float32 model then widens again). One copy either way, never both.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedllm.plugins.quantization.gguf.bf16_gemm import bf16_library

# NOTE 1: the row count oneDNN picks its blocking for; a prompt of a few dozen tokens is the case that gains.
_PACK_ROWS_HINT = 32


@functools.cache
def packed_linear_available() -> bool:
    """Whether this torch build runs oneDNN's bf16 linear on a pre-packed weight (NOTE 1)."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available() and ops._is_mkldnn_bf16_supported()
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class Bf16Matrix:
    """W [N, K] in bf16 for y = x @ W^T (NOTE 1, 2 on its layout); y in `out_dtype`, the model's activations."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32, own_kernel: bool = True) -> None:
        """`own_kernel` False keeps oneDNN even where bf16_gemm.c builds (tools/bench_cpu_gemm.py's baseline)."""
        self.n, self.k = weight.shape
        self.out_dtype = out_dtype
        self._lib = bf16_library() if own_kernel and self.k % 2 == 0 else None  # NOTE 2
        self.packed = self._lib is None and packed_linear_available()
        if self._lib is not None:
            self.weight = self._lib.pack(weight)
            return
        bf16 = weight.to(torch.bfloat16).contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(bf16, _PACK_ROWS_HINT) if self.packed else bf16

    def _c_product(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        assert self._lib is not None
        if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=dtype)
        self._lib.gemm(self.weight, self.n, self.k, x, y)
        return y

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> [M, N] bf16, as the GEMM writes it (for a caller that takes bf16)."""
        if self._lib is not None:
            return self._c_product(x, torch.bfloat16)
        xb = x.to(torch.bfloat16)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(xb, self.weight, None, "none", [], "")
        return F.linear(xb, self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype; a bf16 x is multiplied as it is) -> [M, N] in `out_dtype`."""
        if self._lib is not None and self.out_dtype in (torch.float32, torch.bfloat16):
            return self._c_product(x, self.out_dtype)
        return self.product(x).to(self.out_dtype)
