"""When the model's hot elementwise layers run fused Triton kernels instead of their torch code.

The layers that have a fused kernel (RMSNorm with its residual add, rotary embedding, SiLU/GELU-and-mul)
inherit `FusedOp` and ask `use_fused(self, x)` on every call; the answer depends on their `fused_mode`:

    "auto"    fused on CUDA tensors when triton is installed; the torch code everywhere else (the default)
    "off"     always the torch code (A/B runs: config `fused_ops: false` or PAGEDLLM_FUSED_OPS=false)
    "always"  fused on CPU tensors too, through Triton's interpreter (TRITON_INTERPRET=1): for tests only

NOTE 1: the mode lives on each module, not in a process global, so two engines in one process (tests, an
A/B benchmark) can differ. The builder sets it once on the whole model with `set_fused_ops`.
NOTE 2: on the CPU "auto" never fuses through Triton: the interpreter runs a kernel thousands of times slower
than torch, and the CPU path must stay bit-for-bit what the transformers parity tests check.
NOTE 3: the CPU has its own fused kernels (cpu_ops.c: add+RMSNorm, rotary, SiLU-and-mul, decode attention),
not bit-identical to torch, so they are switched on per model by `set_cpu_ops` -- the engine builder does it
only for float32 models whose weights are kept quantized (their outputs are compared with a stated bound, not
bit for bit); a layer with `cpu_ops` set runs them on float32 CPU tensors instead of its torch code.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedllm.layers.cpu_ops import CpuOps

FusedMode = Literal["auto", "off", "always"]


@functools.cache
def triton_available() -> bool:
    """Whether `triton` can be imported (checked once; importing it is deferred until a kernel runs)."""
    return importlib.util.find_spec("triton") is not None


class FusedOp:
    """Mixin marking a layer with a fused kernel; `fused_mode` is set per module by `set_fused_ops`."""

    fused_mode: FusedMode = "auto"
    cpu_ops: CpuOps | None = None  # set by set_cpu_ops when this model's CPU kernels are on (NOTE 3)


def use_fused(op: FusedOp, x: torch.Tensor) -> bool:
    """True when layer `op` should run its Triton kernel on `x` this call.

    A function, not a method: the layers also inherit nn.Module, whose __getattr__ would shadow a mixin
    method for the type checker.
    """
    mode = op.fused_mode
    if mode == "off":
        return False
    if x.device.type == "cuda":
        return triton_available()
    if mode == "always":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"{type(op).__name__}: fused_mode 'always' on a {x.device.type} tensor needs "
                "TRITON_INTERPRET=1 (Triton's interpreter) set before triton is imported"
            )
        return True
    return False


def cpu_ops_of(op: FusedOp) -> CpuOps | None:
    """Layer `op`'s C kernels, or None for its torch code (a function for the reason `use_fused` is one)."""
    return op.cpu_ops


def set_fused_ops(model: nn.Module, mode: FusedMode) -> int:
    """Set `fused_mode` on every FusedOp module of `model`; returns how many modules were set."""
    if mode not in get_args(FusedMode):
        raise ValueError(f"fused ops mode {mode!r} is not one of {get_args(FusedMode)}")
    count = 0
    for module in model.modules():
        if isinstance(module, FusedOp):
            module.fused_mode = mode
            count += 1
    return count


def set_cpu_ops(model: nn.Module, ops: Any) -> int:
    """Hand `ops` (a cpu_ops.CpuOps, or None to switch off) to every FusedOp module of `model` and to every
    attention impl that takes it (one with a `cpu_ops` attribute: the torch backend's); returns the count."""
    count = 0
    for module in model.modules():
        target = module if isinstance(module, FusedOp) else getattr(module, "impl", None)
        if target is not None and hasattr(target, "cpu_ops"):
            target.cpu_ops = ops
            count += 1
    return count
