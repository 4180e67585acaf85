"""Programmatic dependent launch (PDL) for the decode GEMVs: a GEMV starts while the kernel before it runs.

A decode GEMV at batch 1 is a short stream (qkv of an 8B model in 4-bit: 6.3 MB, ~1.5 us at the HBM's rate),
so its fixed costs -- the launch, the first DRAM round trip, the split-K epilogue -- were most of its time on
the H200 (docs/perf-notes.md §12: ~6-10 us of 7-23 us per W4A16 GEMV). With PDL (Hopper and later) a kernel
launched with the programmatic-serialization attribute may start once every program of the kernel before it
has executed `griddepcontrol.launch_dependents`; it must execute `griddepcontrol.wait` before it touches
anything that kernel writes. The weights are read-only, so each GEMV program prefetches its first step of
weights into L2, then waits, then runs as before:

    primary (norm, activation, GEMV)     griddepcontrol.launch_dependents at its start (`launch_dependents`)
    GEMV launched with launch_pdl=True   prefetch.global.L2 of its first step's weight lines (`prefetch_l2`),
                                         griddepcontrol.wait (`wait_primary`), then loads x, computes, stores

Both instructions are no-ops where they do not apply (a kernel not launched with PDL waits for nothing; a
trigger with no PDL-launched successor frees nothing), so a primary can trigger unconditionally on the GPU.
A kernel that triggers and is followed by an ordinary launch changes nothing: ordinary launches still wait
for every earlier kernel. CUDA-graph capture keeps the attribute as a programmatic edge (CUDA >= 12.3).

Off: PAGEDLLM_PDL=0, the CPU and the Triton interpreter (inline PTX), GPUs before sm_90, a Triton whose
launcher has no `launch_pdl` option. Imported by the kernel modules only (it imports triton).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _launcher_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("PAGEDLLM_PDL", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _launcher_has_pdl()


def pdl_on(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL (module docstring); one cached lookup per call."""
    return x.is_cuda and _pdl_on(x.device.index if x.device.index is not None else torch.cuda.current_device())


@triton.jit
def prefetch_l2(ptrs):
    """prefetch.global.L2 of every address in `ptrs` (one per cache line is enough); keep them in bounds."""
    tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def wait_primary(PDL: tl.constexpr):
    """griddepcontrol.wait: everything the kernel before this one wrote is visible after it."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """griddepcontrol.launch_dependents: a PDL-launched successor may start (it still waits for our writes)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
