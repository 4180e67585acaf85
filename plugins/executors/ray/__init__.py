"""Registers the `ray` executor: tensor-parallel ranks as Ray actors, and data-parallel replicas on Ray.

Chosen by name (`parallel.executor: ray`), or automatically when `parallel.data_parallel_size` > 1 (the
other executors run one replica). Its `plugins.ray` section (RayOptions) says which cluster to join.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import RegisterExecutor, hookimpl


class RayOptions(BaseModel):
    """`plugins.ray`: the cluster and the data-parallel routing."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None, description="Ray cluster to join (e.g. 'auto', 'ray://host:10001'); None: the one this process "
        "is connected to, else a new local one"
    )
    affinity_slack: int = Field(
        4, ge=0, description="data parallel: a request goes to its prefix's replica unless that replica has "
        "more than this many requests above the least-loaded one"
    )


def _load() -> Any:
    from pagedllm.plugins.executors.ray.executor import RayExecutor

    return RayExecutor


@hookimpl
def register_executors(register: RegisterExecutor) -> None:
    register(
        "ray",
        _load,
        priority=0,
        requires=("ray",),
        config_model=RayOptions,
        description="ranks as Ray actors in a placement group per replica; data-parallel replicas on Ray",
    )
