"""Registers the `dummy` loader: a config folder and random weights, for benchmarks (--load-format dummy)."""

from __future__ import annotations

from typing import Any

from pagedllm import hookimpl


def _load() -> Any:
    from pagedllm.plugins.loaders.dummy_loader import DummyLoader

    return DummyLoader


def _check(model: str) -> list[str]:
    # Only by explicit request: random weights must never be chosen silently.
    return ["only used when asked for (loader: dummy / --load-format dummy)"]


@hookimpl
def register_loaders(register: Any) -> None:
    register("dummy", _load, priority=-100, check=_check, description="random weights from a config folder")
