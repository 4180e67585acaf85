"""Registers the `multiproc` executor: tensor-parallel ranks 1..N-1 as local processes (one per rank)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import ExecutorCheckContext, RegisterExecutor, hookimpl


def _load() -> Any:
    from pagedllm.plugins.executors.multiproc.executor import MultiprocExecutor

    return MultiprocExecutor


def _check(parallel: ExecutorCheckContext) -> list[str]:
    dp = parallel.data_parallel_size
    return [] if dp == 1 else [f"runs one replica; parallel.data_parallel_size is {dp}"]


@hookimpl
def register_executors(register: RegisterExecutor) -> None:
    register(
        "multiproc",
        _load,
        priority=5,
        check=_check,
        description="rank 0 in the engine core, ranks 1..N-1 as spawned local processes (gloo on CPU, NCCL on GPU)",
    )
