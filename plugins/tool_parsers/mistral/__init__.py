"""Registers the `mistral` tool parser: `[TOOL_CALLS][{...}]` (and the newer `[TOOL_CALLS]name[ARGS]{...}`)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterToolParser, hookimpl


def _load() -> Any:
    from pagedllm.plugins.tool_parsers.mistral.parser import MistralToolParser

    return MistralToolParser


@hookimpl
def register_tool_parsers(register: RegisterToolParser) -> None:
    register("mistral", _load,
             description="Mistral: [TOOL_CALLS] then a JSON array of calls, or name[ARGS]{json} per call")
