"""When the model's hot elementwise layers run fused Triton kernels instead of their torch code.

The layers that have a fused kernel (RMSNorm with its residual add, rotary embedding, SiLU/GELU-and-mul)
inherit `FusedOp` and ask `use_fused(self, x)` on every call; the answer depends on their `fused_mode`:

    "auto"    fused on CUDA tensors when triton is installed; the torch code everywhere else (the default)
    "off"     always the torch code (A/B runs: config `fused_ops: false` or PAGEDLLM_FUSED_OPS=false)
    "always"  fused on CPU tensors too, through Triton's interpreter (TRITON_INTERPRET=1): for tests only

NOTE 1: the mode lives on each module, not in a process global, so two engines in one process (tests, an
A/B benchmark) can differ. The builder sets it once on the whole model with `set_fused_ops`.
NOTE 2: on the CPU "auto" never fuses: the interpreter runs a kernel thousands of times slower than torch,
and the CPU path must stay bit-for-bit what the transformers parity tests check.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal, get_args

import torch
from torch import nn

FusedMode = Literal["auto", "off", "always"]


@functools.cache
def triton_available() -> bool:
    """Whether `triton` can be imported (checked once; importing it is deferred until a kernel runs)."""
    return importlib.util.find_spec("triton") is not None


class FusedOp:
    """Mixin marking a layer with a fused kernel; `fused_mode` is set per module by `set_fused_ops`."""

    fused_mode: FusedMode = "auto"


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
