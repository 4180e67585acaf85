"""Registers Qwen2 (QKV bias)."""

from __future__ import annotations

from typing import Any

from pagedllm import hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.qwen2_model import Qwen2ForCausalLM

    return Qwen2ForCausalLM


@hookimpl
def register_models(register: Any) -> None:
    register("Qwen2ForCausalLM", _load, description="Qwen2 / Qwen2.5")
