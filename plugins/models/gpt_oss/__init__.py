"""Registers gpt-oss (transformers' GptOssForCausalLM): alternating sliding-window / full attention with learned
attention sinks, and a mixture-of-experts MLP (top-k-then-softmax routing, clamped SwiGLU experts)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.gpt_oss.model import GptOssForCausalLM

    return GptOssForCausalLM


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("GptOssForCausalLM", _load, description="gpt-oss (MoE, attention sinks, local/global layers)")
