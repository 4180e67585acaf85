"""Registers Llama 4's text model (transformers' Llama4ForCausalLM): chunked local attention on the RoPE layers,
full attention without RoPE (NoPE) on every few layers, and mixture-of-experts MLPs with a shared expert."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.llama4.model import Llama4ForCausalLM

    return Llama4ForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("Llama4ForCausalLM", _load, description="Llama 4 text (MoE + shared expert, chunked local / NoPE layers)")
