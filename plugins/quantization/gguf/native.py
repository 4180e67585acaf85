"""The native CPU kernels of the `gguf` method (gguf_cpu.c): compiled once per machine, loaded with ctypes.

    native_library()  -> NativeLibrary, or None with `unavailable_reason()` saying why (no C compiler, a
                         failed build, PAGEDLLM_GGUF_NATIVE=0); callers then use the aten kernels.

The shared object is built with the system C compiler (`$CC`, else `cc`/`gcc`) on first use and cached per
source, flags, compiler and CPU (pagedllm.layers.native_build).

NOTE 1: ``-march=native`` because the file is built where it runs; without AVX2/FMA/F16C the C source falls
back to scalar loops (correct, slow). ``-ffp-contract=off`` keeps the decoded weights bit-identical to
``dequantize_blocks`` (gguf_cpu.c NOTE 1).
NOTE 2: torch must be imported before the library is loaded, so its libgomp is the one our OpenMP calls bind
to (gguf_cpu.c NOTE 3); importing this module imports torch first.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from pagedllm.api.kernels import load_native

SOURCE = Path(__file__).with_name("gguf_cpu.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_DISABLE_ENV = "PAGEDLLM_GGUF_NATIVE"
_reason: str | None = None


class NativeLibrary:
    """Typed wrappers around the two C entry points; tensors must be contiguous CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._matmul = lib.gguf_matmul
        self._matmul.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int]
        self._matmul.restype = c_int
        self._rows = lib.gguf_dequantize_rows
        self._rows.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int]
        self._rows.restype = c_int

    def matmul(self, ggml_type: int, blocks: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, n] = x [M, k] (float32) @ W^T, W the [n, k] matrix whose GGUF blocks are `blocks`."""
        rc = self._matmul(ggml_type, blocks.data_ptr(), n, k, x.data_ptr(), x.shape[0], out.data_ptr(),
                          torch.get_num_threads())
        if rc:
            raise ValueError(f"gguf_matmul: type {ggml_type} with {k} inputs is not supported (rc {rc})")

    def row_call(
        self, ggml_type: int, blocks: torch.Tensor, n: int, k: int, x: torch.Tensor, out: torch.Tensor
    ) -> tuple[Any, ...]:
        """`matmul` of one row with every pointer read now: (C function, its arguments but the thread count).

        For callers that run the same product on the same buffers every step (the CPU decode plan of a
        model): they call `fn(*args, threads)` (non-zero: the type is not supported). The tensors must outlive
        the call, and x must be one row.
        """
        return (self._matmul, ggml_type, blocks.data_ptr(), n, k, x.data_ptr(), 1, out.data_ptr())

    def dequantize_rows(
        self, ggml_type: int, blocks: torch.Tensor, n: int, k: int, ids: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """out [T, k] = W[ids] in float32 (ids None: all n rows); ids int64, contiguous."""
        count = n if ids is None else ids.shape[0]
        rc = self._rows(ggml_type, blocks.data_ptr(), n, k, None if ids is None else ids.data_ptr(), count,
                        out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise IndexError(f"a row id is outside 0..{n - 1}")
        if rc:
            raise ValueError(f"gguf_dequantize_rows: type {ggml_type} with {k} inputs is not supported (rc {rc})")


@functools.cache
def native_library() -> NativeLibrary | None:
    """The compiled kernels, or None (then `unavailable_reason()` says why). Built and loaded once."""
    global _reason
    lib, _reason = load_native(SOURCE, FLAGS, _DISABLE_ENV, "aten's kernels")
    if lib is None:
        return None
    return NativeLibrary(lib)


def unavailable_reason() -> str | None:
    """Why `native_library()` returned None (None if it has not, or has not been asked yet)."""
    return _reason
