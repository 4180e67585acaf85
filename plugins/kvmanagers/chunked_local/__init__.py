"""Registers the `chunked_local` KV manager: Llama 4's chunked local attention, where a token attends only to
its own chunk of `attention_chunk_size` tokens, so the blocks of earlier chunks go back to the pool."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterKVManager, hookimpl


def _load() -> Any:
    from pagedllm.plugins.kvmanagers.chunked_local.manager import ChunkedLocalManager

    return ChunkedLocalManager


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    from pagedllm.api import ChunkedLocalAttentionSpec

    register(
        "chunked_local",
        _load,
        spec_type=ChunkedLocalAttentionSpec,
        description="attention within chunks of attention_chunk_size tokens; earlier chunks' blocks are released",
    )
