"""Registers the `gguf` loader: one .gguf file (weights, config, tokenizer and chat template inside)."""

from __future__ import annotations

import os
from typing import Any

from pagedllm.api import LoaderCheckContext, RegisterLoader, hookimpl


def _load() -> Any:
    from pagedllm.plugins.loaders.gguf.loader import GGUFLoader

    return GGUFLoader


def _check(model: LoaderCheckContext) -> list[str]:
    if not model.endswith(".gguf"):
        return [f"'{model}' is not a .gguf file"]
    if not os.path.isfile(model):
        return [f"'{model}' does not exist"]
    return []


@hookimpl
def register_loaders(register: RegisterLoader) -> None:
    register("gguf", _load, priority=10, requires=("gguf",), check=_check, description="GGUF file (kept quantized on the CPU, else dequantized at load)")
