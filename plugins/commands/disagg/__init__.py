"""Registers the `disagg` command: `pagedllm disagg`, the router in front of a prefill and a decode server.

Light on purpose: `load()` gives the flag-declaring module (`cli.py`); the proxy (FastAPI, uvicorn, the
standard library's HTTP client) is imported only when the command runs.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterCommand, hookimpl


def _load() -> Any:
    from pagedllm.plugins.commands.disagg import cli

    return cli


@hookimpl
def register_commands(register: RegisterCommand) -> None:
    register("disagg", _load, description="route OpenAI requests through a prefill server, then a decode server")
