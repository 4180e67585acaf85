"""Registers the `fcfs` scheduler: continuous batching, chunked prefill, preemption by recompute."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterScheduler, hookimpl


def _load() -> Any:
    from pagedllm.plugins.schedulers.fcfs.scheduler import FCFSScheduler

    return FCFSScheduler


@hookimpl
def register_schedulers(register: RegisterScheduler) -> None:
    register("fcfs", _load, description="first come first served continuous batching with chunked prefill")
