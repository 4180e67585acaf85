"""Registers Gemma 2 (interleaved sliding-window and global attention, soft-capping): two KV-cache groups."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.llama.gemma2 import Gemma2ForCausalLM

    return Gemma2ForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("Gemma2ForCausalLM", _load, description="Gemma 2 (local/global layers, soft-capping)")
