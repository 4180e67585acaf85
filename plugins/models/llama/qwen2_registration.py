"""Registers Qwen2 (QKV bias)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.llama.qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("Qwen2ForCausalLM", _load, description="Qwen2 / Qwen2.5")
