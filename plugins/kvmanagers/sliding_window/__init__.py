"""Registers the sliding-window KV manager (blocks wholly behind the window go back to the pool)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterKVManager, hookimpl


def _load() -> Any:
    from pagedllm.plugins.kvmanagers.sliding_window.manager import SlidingWindowManager

    return SlidingWindowManager


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    from pagedllm.api import SlidingWindowSpec

    register(
        "sliding_window",
        _load,
        spec_type=SlidingWindowSpec,
        description="attention over the last `sliding_window` tokens; older blocks are released",
    )
