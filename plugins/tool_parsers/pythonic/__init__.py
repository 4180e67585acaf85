"""Registers the `pythonic` tool parser: a Python list of calls, `[get_weather(city="Paris"), ...]`."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterToolParser, hookimpl


def _load() -> Any:
    from pagedllm.plugins.tool_parsers.pythonic.parser import PythonicToolParser

    return PythonicToolParser


@hookimpl
def register_tool_parsers(register: RegisterToolParser) -> None:
    register("pythonic", _load,
             description='Llama 3.2 / 4 style: a Python list of calls, [f(a=1), g(b="x")]')
