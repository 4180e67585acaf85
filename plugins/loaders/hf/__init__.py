"""Registers the `hf` loader: a Hugging Face model folder (config.json + safetensors or .bin / .pt, sharded or not)."""

from __future__ import annotations

import os
from typing import Any

from pagedllm.api import LoaderCheckContext, RegisterLoader, hookimpl


def _load() -> Any:
    from pagedllm.plugins.loaders.hf.loader import HFLoader

    return HFLoader


def _check(model: LoaderCheckContext) -> list[str]:
    if not os.path.isdir(model):
        return [f"'{model}' is not a directory"]
    if not os.path.isfile(os.path.join(model, "config.json")):
        return [f"no config.json in '{model}'"]
    return []


@hookimpl
def register_loaders(register: RegisterLoader) -> None:
    register("hf", _load, priority=10, check=_check, description="HF folder with config.json and safetensors or .bin / .pt")
