"""Registers BART (BartForConditionalGeneration): the encoder-decoder whose cross-attention K/V live in their own
KV-cache group (the `cross_attention` KV manager)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterModel, hookimpl


def _load() -> Any:
    from pagedllm.plugins.models.bart.model import BartForConditionalGeneration

    return BartForConditionalGeneration


@hookimpl
def register_models(register: RegisterModel) -> None:
    register("BartForConditionalGeneration", _load, description="BART (encoder-decoder; cross-attention KV group)")
