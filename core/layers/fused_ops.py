"""When the model's hot elementwise layers run fused kernels instead of their torch code.

The layers that have a fused kernel (RMSNorm with its residual add, rotary embedding, SiLU/GELU-and-mul)
inherit `FusedOp` and ask `use_fused(self, x)` on every call; the answer depends on their `fused_mode`:

    "auto"    fused on CUDA tensors when triton is installed; the torch code everywhere else (the default)
    "off"     always the torch code (A/B runs: config `fused_ops: false` or PAGEDLLM_FUSED_OPS=false)
    "always"  fused on CPU tensors too, through Triton's interpreter (TRITON_INTERPRET=1): for tests only

NOTE 1: the mode and the CPU kernels are the engine's `KernelOptions` (pagedllm.protocols.model), fixed on
each layer when it is built: a FusedOp reads the options of the build it is constructed in
(`building(options)`, which the engine's builder wraps around the model's construction), so two engines in
one process can differ and nothing patches a built model afterwards. These layers take no build context of
their own (RMSNorm(hidden, eps) is the signature every model uses), hence the scoped context variable;
outside any build they get the defaults.
NOTE 2: on the CPU "auto" never fuses through Triton: the interpreter runs a kernel thousands of times slower
than torch, and the CPU path must stay bit-for-bit what the transformers parity tests check.
NOTE 3: the CPU has its own fused C kernels (add+RMSNorm, rotary, SiLU-and-mul, decode attention), not
bit-identical to torch, so a quantization method whose outputs already differ from the float model brings
them (the gguf method's `cpu_fused_ops()`), and the builder puts them in `KernelOptions.cpu_ops` only for a
float32 CPU model of that method; a layer with `cpu_ops` set runs them on float32 CPU tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, get_args

import torch

from pagedllm.protocols.model import FusedMode, KernelOptions

# KernelOptions is a frozen dataclass: one shared default is safe.
_BUILDING: ContextVar[KernelOptions] = ContextVar("pagedllm_kernel_options", default=KernelOptions())  # noqa: B039


@contextmanager
def building(options: KernelOptions) -> Iterator[None]:
    """Layers constructed inside take `options` (NOTE 1)."""
    if options.fused_ops not in get_args(FusedMode):
        raise ValueError(f"fused ops mode {options.fused_ops!r} is not one of {get_args(FusedMode)}")
    token = _BUILDING.set(options)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def current_kernel_options() -> KernelOptions:
    """The options of the build in progress (the defaults outside one)."""
    return _BUILDING.get()


@functools.cache
def triton_available() -> bool:
    """Whether `triton` can be imported (checked once; importing it is deferred until a kernel runs)."""
    return importlib.util.find_spec("triton") is not None


class FusedOp:
    """Mixin marking a layer with a fused kernel; its mode and CPU kernels come from the build (NOTE 1)."""

    fused_mode: FusedMode = "auto"
    cpu_ops: Any = None  # the build's CPU fused ops (NOTE 3), or None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = _BUILDING.get()
        self.fused_mode = options.fused_ops
        self.cpu_ops = options.cpu_ops


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


def cpu_ops_of(op: FusedOp) -> Any:
    """Layer `op`'s C kernels, or None for its torch code (a function for the reason `use_fused` is one)."""
    return op.cpu_ops


def set_fused_ops(model: torch.nn.Module, mode: FusedMode) -> int:
    """Flip `fused_mode` on every FusedOp module of a built `model`; returns how many were set.

    For A/B tests and benchmarks that compare the fused kernels with the torch code on one loaded model; the
    engine never calls it (its layers take the mode at construction, NOTE 1).
    """
    if mode not in get_args(FusedMode):
        raise ValueError(f"fused ops mode {mode!r} is not one of {get_args(FusedMode)}")
    count = 0
    for module in model.modules():
        if isinstance(module, FusedOp):
            module.fused_mode = mode
            count += 1
    return count
