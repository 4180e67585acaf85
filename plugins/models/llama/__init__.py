"""Registers the Llama family (Llama 2/3, SmolLM2) and Mistral (whose uniform sliding window the KV manager honours)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.llama.model import LlamaForCausalLM

    return LlamaForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("LlamaForCausalLM", _load, description="Llama 2/3, SmolLM2")
    register("MistralForCausalLM", _load, description="Mistral (sliding window when every layer has one)")
