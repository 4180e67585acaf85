"""Registers the `hermes` tool parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterToolParser, hookimpl


def _load() -> Any:
    from pagedllm.plugins.tool_parsers.hermes.parser import HermesToolParser

    return HermesToolParser


@hookimpl
def register_tool_parsers(register: RegisterToolParser) -> None:
    register("hermes", _load, description="Hermes 2 Pro / Qwen2.5 / Qwen3: <tool_call>{json}</tool_call> blocks")
