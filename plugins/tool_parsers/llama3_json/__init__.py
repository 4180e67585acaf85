"""Registers the `llama3_json` tool parser: Llama 3.1-3.3's JSON calls, `{"name": ..., "parameters": {...}}`."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterToolParser, hookimpl


def _load() -> Any:
    from pagedllm.plugins.tool_parsers.llama3_json.parser import Llama3JsonToolParser

    return Llama3JsonToolParser


@hookimpl
def register_tool_parsers(register: RegisterToolParser) -> None:
    register("llama3_json", _load,
             description='Llama 3.1-3.3 JSON tool calls: {"name": ..., "parameters": {...}}, "; "-separated')
