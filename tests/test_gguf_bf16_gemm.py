"""bf16_gemm.c, the bf16 GEMM of a GGUF matrix's batch products: against float64 sums of the same bf16-rounded
operands, on every tail of its register tile (rows, 16-column panels, strips) and both dtypes in and out."""

from __future__ import annotations

import pytest
import torch

from pagedllm.plugins.quantization.gguf.batch_gemm import Bf16Matrix
from pagedllm.plugins.quantization.gguf.bf16_gemm import bf16_library

lib = bf16_library()
needs_kernel = pytest.mark.skipif(lib is None, reason="bf16_gemm.c needs AVX512-BF16 (this CPU or build lacks it)")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T of the bf16-rounded operands, summed in float64 (what the kernel's float32 sums approximate)."""
    return x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 7, 8, 9, 15, 16, 17, 24, 33])
@pytest.mark.parametrize(("n", "k"), [(16, 64), (100, 96), (48 * 3 + 5, 576), (576, 1536)])
def test_the_kernel_equals_the_bf16_products(m: int, n: int, k: int) -> None:
    assert lib is not None
    torch.manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k), torch.randn(m, k)
    packed = lib.pack(w)
    y = torch.full((m, n), float("nan"))
    lib.gemm(packed, n, k, x, y)
    torch.testing.assert_close(y.double(), reference(x, w), rtol=1e-5, atol=1e-4 * k**0.5)
    # A bf16 input is the same product; a bf16 output is the float32 sum rounded once.
    y16 = torch.empty(m, n, dtype=torch.bfloat16)
    lib.gemm(packed, n, k, x.to(torch.bfloat16), y16)
    again = torch.empty(m, n)
    lib.gemm(packed, n, k, x.to(torch.bfloat16), again)
    assert torch.equal(again, y) and torch.equal(y16, y.to(torch.bfloat16))


@needs_kernel
def test_threads_and_runs_do_not_change_a_bit() -> None:
    assert lib is not None
    w, x = torch.randn(3072, 576), torch.randn(40, 576)
    packed = lib.pack(w)
    outs = []
    for threads in (1, 2, 1):
        with_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            y = torch.empty(40, 3072)
            lib.gemm(packed, 3072, 576, x, y)
        finally:
            torch.set_num_threads(with_threads)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    # Each row's outputs are its own: the first 5 rows alone give the same bits as inside the batch.
    alone = torch.empty(5, 3072)
    lib.gemm(packed, 3072, 576, x[:5].contiguous(), alone)
    assert torch.equal(alone, outs[0][:5])


def test_the_matrix_answers_in_the_models_dtype_on_either_kernel() -> None:
    w, x = torch.randn(80, 64), torch.randn(12, 64)
    for k_odd in (False, True):  # an odd K has no bf16_gemm.c panels: oneDNN / F.linear take it
        ww, xx = (w[:, :63].contiguous(), x[:, :63].contiguous()) if k_odd else (w, x)
        matrix = Bf16Matrix(ww)
        y = matrix(xx)
        assert y.dtype == torch.float32 and y.shape == (12, 80)
        torch.testing.assert_close(y.double(), reference(xx, ww), rtol=2**-7, atol=0.05)
        assert matrix.product(xx).dtype == torch.bfloat16
