"""Registers the `uniproc` executor: the model runs in the engine core's own process (tensor_parallel_size 1)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import ExecutorCheckContext, RegisterExecutor, hookimpl


def _load() -> Any:
    from pagedllm.plugins.executors.uniproc.executor import UniprocExecutor

    return UniprocExecutor


def _check(parallel: ExecutorCheckContext) -> list[str]:
    reasons = []
    if parallel.tensor_parallel_size != 1:
        reasons.append(f"runs one rank; parallel.tensor_parallel_size is {parallel.tensor_parallel_size}")
    if parallel.pipeline_parallel_size != 1:
        reasons.append(f"runs one rank; parallel.pipeline_parallel_size is {parallel.pipeline_parallel_size}")
    if parallel.data_parallel_size != 1:
        reasons.append(f"runs one replica; parallel.data_parallel_size is {parallel.data_parallel_size}")
    return reasons


@hookimpl
def register_executors(register: RegisterExecutor) -> None:
    register("uniproc", _load, priority=10, check=_check, description="one rank, in the engine core's process")
