"""Registers the `top` command: `pagedllm top`, a terminal view of a running server's /metrics.

Light on purpose: `load()` gives the flag-declaring module (`cli.py`); scraping and drawing import only the
standard library and prometheus_client's text parser, and only when the command runs.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterCommand, hookimpl


def _load() -> Any:
    from pagedllm.plugins.commands.top import cli

    return cli


@hookimpl
def register_commands(register: RegisterCommand) -> None:
    register("top", _load, description="a live terminal view of a running server's /metrics")
