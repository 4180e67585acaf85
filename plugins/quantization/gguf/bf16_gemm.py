"""The bf16 GEMM of bf16_gemm.c (its NOTEs 1-3: the layout, the arithmetic, the tile), loaded with ctypes.

    bf16_library()  -> Bf16Library, or None with `unavailable_reason()` saying why (no C compiler, a failed
                       build, no AVX512-BF16 in this build, PAGEDLLM_GGUF_BF16_GEMM=0)

batch_gemm.Bf16Matrix packs a matrix for it and runs it below its oneDNN crossover (batch_gemm.py NOTE 2).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedllm.api.kernels import load_native

SOURCE = Path(__file__).with_name("bf16_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_DISABLE_ENV = "PAGEDLLM_GGUF_BF16_GEMM"
_reasons: dict[tuple[int, int] | None, str | None] = {}


class Bf16Library:
    """Typed wrappers around bf16_gemm.c's entry points; tensors must be contiguous CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._pack = lib.b16_pack
        self._pack.argtypes = [ptr, i64, i64, ptr, c_int]
        self._pack.restype = c_int
        self._gemm = lib.b16_gemm
        self._gemm.argtypes = [ptr, i64, i64, ptr, c_int, i64, ptr, c_int, c_int]
        self._gemm.restype = c_int
        self.tile = int(lib.b16_tile())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] (float32) -> bf16 [ceil(N/16) * 16 * K] in bf16_gemm.c NOTE 1's panels."""
        w = weight.to(torch.float32).contiguous()
        n, k = w.shape
        out = torch.empty((n + 15) // 16 * 16 * k, dtype=torch.bfloat16)
        if self._pack(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"b16_pack: {k} inputs (K must be even)")
        return out

    def gemm(self, packed: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, n] = x [M, k] @ W^T; x and out contiguous, each float32 or bf16 (bf16_gemm.c NOTE 2)."""
        rc = self._gemm(packed.data_ptr(), n, k, x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0],
                        out.data_ptr(), int(out.dtype == torch.bfloat16), torch.get_num_threads())
        if rc:
            raise ValueError(f"b16_gemm: {k} inputs not supported or out of memory (rc {rc})")


def _flags(tile: tuple[int, int] | None) -> list[str]:
    return FLAGS if tile is None else [*FLAGS, f"-DB16_MR={tile[0]}", f"-DB16_NR={tile[1]}"]


@functools.cache
def bf16_library(tile: tuple[int, int] | None = None) -> Bf16Library | None:
    """The compiled kernel, or None (then `unavailable_reason()` says why). `tile` (rows, 16-column panels)
    overrides bf16_gemm.c's register tile, for tools/bench_cpu_gemm.py."""
    lib, reason = load_native(SOURCE, _flags(tile), _DISABLE_ENV, "oneDNN's bf16 GEMM")
    if lib is not None and not lib.b16_available():
        lib, reason = None, "bf16_gemm.c was built without AVX512-BF16 / AVX512-BW (the compiler's -march=native)"
    _reasons[tile] = reason
    return None if lib is None else Bf16Library(lib)


def unavailable_reason(tile: tuple[int, int] | None = None) -> str | None:
    """Why `bf16_library()` returned None (None if it has not, or has not been asked yet)."""
    return _reasons.get(tile)
