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

Which GEMVs use it: PDL_KERNELS, or PAGEDLLM_PDL=all | none | w4a16,dense. Never on the CPU or under the
Triton interpreter (inline PTX), on GPUs before sm_90, or with a Triton whose launcher has no `launch_pdl`.
Imported by the kernel modules only (it imports triton).
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


# The GEMVs that launch with PDL unless PAGEDLLM_PDL names others ("all", "none" or a comma list): measured on
# the H200 (docs/perf-notes.md §12) the W4A16 GEMV gained (W3 2.77 -> 2.70 ms/token) and the dense one lost
# (bf16 W3 4.35 -> 4.55), so only "w4a16" is on by default.
PDL_KERNELS = ("w4a16",)
KNOWN_KERNELS = ("w4a16", "dense")


@functools.cache
def _pdl_kernels() -> frozenset[str]:
    raw = os.environ.get("PAGEDLLM_PDL")
    if raw is None:
        return frozenset(PDL_KERNELS)
    value = raw.strip().lower()
    if value in ("all", "1", "true", "on", "yes"):
        return frozenset(KNOWN_KERNELS)
    if value in ("none", "0", "false", "off", "no", ""):
        return frozenset()
    names = frozenset(v.strip() for v in value.split(","))
    unknown = sorted(names - set(KNOWN_KERNELS))
    if unknown:
        raise ValueError(f"PAGEDLLM_PDL={raw!r}: unknown {unknown}; use all, none or a list of {KNOWN_KERNELS}")
    return names


@functools.cache
def _pdl_on(device_index: int, kernel: str) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or kernel not in _pdl_kernels():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _launcher_has_pdl()


def pdl_on(x: torch.Tensor, kernel: str) -> bool:
    """Whether `kernel` (one of KNOWN_KERNELS) launches with PDL on x's device (module docstring); one cached
    lookup per call."""
    if not x.is_cuda:
        return False
    return _pdl_on(x.device.index if x.device.index is not None else torch.cuda.current_device(), kernel)


def trigger_on(x: torch.Tensor) -> bool:
    """Whether a kernel that may precede a PDL GEMV (RMSNorm, act_and_mul) should trigger its dependents."""
    return any(pdl_on(x, kernel) for kernel in KNOWN_KERNELS)


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
