"""Registers Qwen3 (per-head q/k RMSNorm)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.llama.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("Qwen3ForCausalLM", _load, description="Qwen3 (dense)")
