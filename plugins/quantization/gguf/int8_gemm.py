"""The int8 copy of a GGUF matrix that NativeKernel's large products (>= INT8_COPY_ROWS rows) multiply by on
CPUs with AVX512-VNNI (int8_gemm.c: the layout, the math and the tile are its NOTEs 1-3).

    int8_library()  -> Int8Library, or None with `unavailable_reason()` saying why (no C compiler, a failed
                       build, no AVX512-VNNI in this build, PAGEDLLM_GGUF_INT8=0)
    Int8Matrix      one [N, K] Q4_0 / Q4_1 / Q8_0 matrix repacked at load; `Int8Matrix(...)(x)` is x @ W^T

The activations are quantized to int8 per 32 values inside each call, as llama.cpp does for these types;
the weights keep their exact 4-bit (or 8-bit) values and their per-32 scales.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedllm.api.kernels import load_native

SOURCE = Path(__file__).with_name("int8_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_DISABLE_ENV = "PAGEDLLM_GGUF_INT8"
_reasons: dict[tuple[int, ...] | None, str | None] = {}


class Int8Library:
    """Typed wrappers around int8_gemm.c's entry points; tensors must be contiguous CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._pack = lib.i8_pack
        self._pack.argtypes = [c_int, ptr, i64, i64, ptr, ptr, c_int]
        self._pack.restype = c_int
        self._gemm = lib.i8_gemm
        self._gemm.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, c_int, c_int]
        self._gemm.restype = c_int
        self._quantize = lib.i8_quantize
        self._quantize.argtypes = [ptr, i64, i64, ptr, ptr, ptr]
        self._quantize.restype = c_int
        self.tile = int(lib.i8_tile())

    def pack(self, ggml_type: int, blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(u8 [ceil(n/16)*16*k], float32 [ceil(n/16) * k/32 * 32]): int8_gemm.c NOTE 1's layout."""
        panels = (n + 15) // 16
        wq = torch.empty(panels * 16 * k, dtype=torch.uint8)
        dc = torch.empty(panels * (k // 32) * 32, dtype=torch.float32)
        blocks = blocks.contiguous()
        rc = self._pack(ggml_type, blocks.data_ptr(), n, k, wq.data_ptr(), dc.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"i8_pack: type {ggml_type} with {k} inputs is not supported (rc {rc})")
        return wq, dc

    def gemm(self, wq: torch.Tensor, dc: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor,
             precise: bool = False) -> None:
        """out [M, n] (float32) = x [M, k] (float32, contiguous) @ W^T; `precise`: 16-bit activations
        (int8_gemm.c NOTE 4), else 8-bit (NOTE 2)."""
        rc = self._gemm(wq.data_ptr(), dc.data_ptr(), n, k, x.data_ptr(), x.shape[0], out.data_ptr(),
                        torch.get_num_threads(), int(precise))
        if rc:
            raise ValueError(f"i8_gemm: {k} inputs not supported or out of memory (rc {rc})")

    def quantize(self, x: torch.Tensor, precise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 -> (q [M, K], s [M, K/32, 2]: scale, scale * sum q), as i8_gemm rounds it: q int8,
        or with `precise` the 16-bit q = 256 hi + lo as int32 (int8_gemm.c NOTE 4)."""
        x = x.to(torch.float32).contiguous()
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        lo = torch.empty(m, k, dtype=torch.int8) if precise else None
        s = torch.empty(m, k // 32, 2)
        if self._quantize(x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), None if lo is None else lo.data_ptr()):
            raise ValueError(f"i8_quantize: {k} inputs not supported")
        if lo is not None:
            return q.int() * 256 + lo.int(), s
        return q, s


def _flags(tile: tuple[int, ...] | None) -> list[str]:
    if tile is None:
        return FLAGS
    names = ["I8_MR", "I8_NR", "I8_PREFETCH", "I8_CHUNKED"]
    return [*FLAGS, *(f"-D{name}={v}" for name, v in zip(names, tile, strict=False))]


@functools.cache
def int8_library(tile: tuple[int, ...] | None = None) -> Int8Library | None:
    """The compiled kernel, or None (then `unavailable_reason()` says why). `tile` (rows, 16-column panels
    [, prefetch, chunked]) overrides int8_gemm.c's register tile and NOTE 5's switches, for
    tools/bench_cpu_gemm.py."""
    lib, reason = load_native(SOURCE, _flags(tile), _DISABLE_ENV, "the bf16 batch GEMM")
    if lib is not None and not lib.i8_available():
        lib, reason = None, "int8_gemm.c was built without AVX512-VNNI / AVX512-BW (the compiler's -march=native)"
    _reasons[tile] = reason
    return None if lib is None else Int8Library(lib)


def unavailable_reason(tile: tuple[int, ...] | None = None) -> str | None:
    """Why `int8_library()` returned None (None if it has not, or has not been asked yet)."""
    return _reasons.get(tile)


class Int8Matrix:
    """W [N, K] (GGUF Q4_0 / Q4_1 / Q8_0 blocks) repacked for i8_gemm; y = x @ W^T in `out_dtype`, the
    activations rounded to 8 bits per 32 (int8_gemm.c NOTE 2) or, `precise`, to 16 (NOTE 4)."""

    def __init__(self, lib: Int8Library, ggml_type: int, blocks: torch.Tensor, n: int, k: int,
                 out_dtype: torch.dtype = torch.float32, precise: bool = False) -> None:
        self.lib, self.n, self.k, self.out_dtype, self.precise = lib, n, k, out_dtype, precise
        self.wq, self.dc = lib.pack(ggml_type, blocks, n, k)

    @property
    def nbytes(self) -> int:
        return self.wq.numel() + self.dc.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> [M, N] in `out_dtype`."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.n)
        self.lib.gemm(self.wq, self.dc, self.n, self.k, x, y, self.precise)
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)
