"""Registers the attention-free Mamba models: Mamba-1 (MambaForCausalLM) and Mamba-2 (Mamba2ForCausalLM)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load_mamba() -> Any:
    from pagedllm.plugins.models.mamba.model import MambaForCausalLM

    return MambaForCausalLM


def _load_mamba2() -> Any:
    from pagedllm.plugins.models.mamba.model import Mamba2ForCausalLM

    return Mamba2ForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("MambaForCausalLM", _load_mamba, description="Mamba-1 (selective SSM; one state per request)")
    register("Mamba2ForCausalLM", _load_mamba2, description="Mamba-2 (SSD; one state per request)")
