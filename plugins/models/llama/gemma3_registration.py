"""Registers Gemma 3 text models (`gemma3_text`: 5 local : 1 global layers, q/k norms, a RoPE per type)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.llama.gemma3 import Gemma3ForCausalLM

    return Gemma3ForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("Gemma3ForCausalLM", _load, description="Gemma 3 text (local/global layers, q/k norms)")
