"""Registers the unquantized method `none`: dense weights in the model dtype (the default), with the GPU's
dense kernels (a decode GEMV, a gated GEMM; method.py). Light module: no torch import here."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterQuantizationMethod, hookimpl


def _load() -> Any:
    from pagedllm.plugins.quantization.unquantized.method import UnquantizedConfig

    return UnquantizedConfig


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register("none", _load, description="dense weights in the model dtype")
