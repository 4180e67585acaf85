"""Registers the `openai` entrypoint: the OpenAI-compatible FastAPI server behind `pagedllm serve`.

Light on purpose: fastapi, uvicorn and zmq are imported only when the entrypoint is resolved.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterEntrypoint, hookimpl
from pagedllm.plugins.server.options import ServerSection


def _load() -> Any:
    from pagedllm.plugins.server.run import serve

    return serve


@hookimpl
def register_entrypoints(register: RegisterEntrypoint) -> None:
    register(
        "openai", _load, priority=10, requires=("fastapi", "uvicorn", "zmq", "msgspec", "prometheus_client"),
        description="OpenAI-compatible HTTP server (FastAPI + uvicorn) on an engine-core process",
        config_model=ServerSection,
    )
