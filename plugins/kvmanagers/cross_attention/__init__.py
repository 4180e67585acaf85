"""Registers the `cross_attention` KV manager: an encoder-decoder model's encoder output, one block list per
request sized from its encoder prompt, allocated once and freed with the request."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterKVManager, hookimpl


def _load() -> Any:
    from pagedllm.plugins.kvmanagers.cross_attention.manager import CrossAttentionManager

    return CrossAttentionManager


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    from pagedllm.api import CrossAttentionSpec

    register(
        "cross_attention",
        _load,
        spec_type=CrossAttentionSpec,
        description="encoder output K/V for cross-attention: allocated once per request, never grown or cached",
    )
