"""Registers the unquantized method: plain dense weights in the model dtype (the default)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterQuantizationMethod, hookimpl


def _load() -> Any:
    from pagedllm.api.quantization import UnquantizedConfig

    return UnquantizedConfig


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register("none", _load, description="dense weights in the model dtype")
