"""`tool_choice` "required" or a named function: the JSON schema the output is held to, and its parsers.

As in vLLM (`_get_json_schema_from_tool` in vllm/entrypoints/openai/protocol.py): "required" constrains the
output to a JSON array of `{"name": <one of the tools>, "parameters": <that tool's parameters>}` (at least
one item; at most one when `parallel_tool_calls` is false); a named function constrains it to that
function's parameters object alone. Either way the text is JSON, so these parsers need no markers.
"""

from __future__ import annotations

from typing import Any

from pagedllm.parsers.incremental import (
    IncrementalToolParser,
    PartialToolCall,
    ToolPrefix,
    scan_call_objects,
)
from pagedllm.parsers.json_scan import JSONScanError, scan_value, skip_ws

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = tool["function"]
    return function


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's `function.parameters` (an object schema), or the empty object schema when it has none."""
    params = _function(tool).get("parameters")
    return dict(params) if params else dict(_EMPTY_PARAMETERS)


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The schema for tool_choice "required": an array of calls, each naming one tool with its parameters.

    Each tool's `$defs` are lifted to the top (a `$ref` inside resolves against the document root); two
    tools defining the same name differently cannot share one root, so that is refused.
    """
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = parameters_schema(tool)
        for name, definition in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise ValueError(f"tools define $defs.{name} differently; one request cannot use both")
            defs[name] = definition
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [_function(tool)["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schema for a named tool_choice: that function's parameters. KeyError when no tool has that name."""
    for tool in tools:
        if _function(tool)["name"] == name:
            return parameters_schema(tool)
    raise KeyError(name)


class RequiredToolCallsParser(IncrementalToolParser):
    """Reads the JSON array "required" produces: `[{"name": ..., "parameters": {...}}, ...]`."""

    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        i = skip_ws(text, 0)
        if i == len(text):
            return ToolPrefix("", valid=not final)
        if text[i] != "[":
            return ToolPrefix(text, valid=False)
        calls: list[PartialToolCall] = []
        try:
            scan_call_objects(text, i + 1, calls)
        except JSONScanError:
            return ToolPrefix(text if final else "", calls, valid=False)
        return ToolPrefix("", calls)


class NamedToolCallParser(IncrementalToolParser):
    """Reads a named tool_choice's output: the whole text is that one function's arguments object."""

    def __init__(self, context: Any, name: str) -> None:
        super().__init__(context)
        self.name = name

    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        i = skip_ws(text, 0)
        if i == len(text):
            return ToolPrefix("", [PartialToolCall(self.name, "", False)], valid=not final)
        try:
            end, complete = scan_value(text, i)
        except JSONScanError:
            return ToolPrefix(text if final else "", valid=False)
        return ToolPrefix("", [PartialToolCall(self.name, text[i:end], complete)])
