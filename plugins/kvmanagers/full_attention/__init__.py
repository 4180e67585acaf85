"""Registers the full-attention KV manager (the cache grows one slot per token; nothing is released early)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterKVManager, hookimpl


def _load() -> Any:
    from pagedllm.plugins.kvmanagers.full_attention.manager import FullAttentionManager

    return FullAttentionManager


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    from pagedllm.api import FullAttentionSpec

    register("full_attention", _load, spec_type=FullAttentionSpec, description="causal attention over all tokens")
