"""Registers the `dummy` loader: a config folder and random weights, for benchmarks (--load-format dummy)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterLoader, hookimpl


def _load() -> Any:
    from pagedllm.plugins.loaders.dummy.loader import DummyLoader

    return DummyLoader


@hookimpl
def register_loaders(register: RegisterLoader) -> None:
    # explicit_only: random weights must never be chosen silently (loader: dummy / --load-format dummy).
    register("dummy", _load, priority=-100, explicit_only=True, description="random weights from a config folder")
