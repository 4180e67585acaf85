"""paged_attention.c loaded with ctypes: `paged_attention()` -> the C call, or None with the reason.

Built on first use through `pagedllm.api.kernels.load_native` (-O3 -march=native: AVX512-BF16's dot products
where the CPU has them), cached per machine. `PAGEDLLM_CPU_ATTENTION=0` turns it off; the backend's check then
refuses the CPU with that reason, so the selector falls back to `torch`.

NOTE 1: the call is on the per-layer path (one per layer and step): arguments are plain ints from
`data_ptr()` and argtypes are set once; the shape and layout checks are the backend's, made once per step.
NOTE 2: the C call's threads are an OpenMP team (paged_attention.c NOTE 3), so torch is imported before the
library loads: its libgomp is then the one the team comes from, torch's own thread pool.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch  # noqa: F401  (NOTE 2)

from pagedllm.api.kernels import load_native

SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
DISABLE_ENV = "PAGEDLLM_CPU_ATTENTION"
_reason: list[str | None] = [None]


@functools.cache
def paged_attention() -> Callable[..., int] | None:
    """`cpu_paged_attention` of the compiled library (argtypes set), or None: `unavailable_reason()` says why."""
    lib, _reason[0] = load_native(SOURCE, FLAGS, DISABLE_ENV, "the torch attention backend")
    if lib is None:
        return None
    fn = lib.cpu_paged_attention
    p, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    fn.argtypes = [p, i64, p, i64, p, i64, p, i64, i64, i64, i64, i64, p, i64, p, p, p, i64, i64, f32, i64, f32,
                   c_int, c_int, p, i64, i64]
    fn.restype = c_int
    return fn


def unavailable_reason() -> str | None:
    """Why `paged_attention()` returned None (None when it has not, or has not been asked yet)."""
    return _reason[0]
