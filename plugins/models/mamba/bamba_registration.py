"""Registers Bamba (BambaForCausalLM): Mamba-2 layers interleaved with full-attention layers."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.mamba.bamba import BambaForCausalLM

    return BambaForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("BambaForCausalLM", _load, description="Bamba: Mamba-2 + attention hybrid (two KV-cache groups)")
