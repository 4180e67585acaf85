"""A chat request's tool use: what tool_choice asks for, the template's view of the messages, the constraint.

    tool_choice   parser                         output constrained to                 finish_reason
    none          -                              -                                     as generated
    auto          --tool-call-parser's plugin    -                                     tool_calls if any
    required      the JSON array's parser        [{"name", "parameters"}, ...] schema  tool_calls
    {function}    the arguments object's parser  that function's parameters schema     tool_calls

Without tool_choice, requests with tools mean "auto" (OpenAI's default), which like vLLM needs
`--enable-auto-tool-choice` and a tool parser: otherwise a 400 says so rather than ignoring the tools.
"required" and a named function are held to their schema by the structured-output engine
(SamplingParams.structured_outputs), so their arguments always parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.api.parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolParserContext,
    named_schema,
    required_schema,
)
from pagedllm.plugins.server.chat_parsing import ChatParsing
from pagedllm.plugins.server.errors import APIError
from pagedllm.plugins.server.protocol import ChatCompletionRequest, ChatMessage


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as OpenAI objects, for the template and the parsers
    schema: dict[str, Any] | None = None  # the JSON schema the output is held to (required / named)
    function: str | None = None  # the named function
    max_calls: int | None = None  # 1 when parallel_tool_calls is false

    def parser(self, parsing: ChatParsing, tokenizer: Any) -> Any:
        """A fresh tool parser for one choice (None: the output is not parsed for calls)."""
        context = ToolParserContext(tokenizer, self.tools)
        if self.mode == "required":
            return RequiredToolCallsParser(context)
        if self.mode == "named":
            return NamedToolCallParser(context, str(self.function))
        if self.mode == "auto":
            return parsing.tool_parser(context)
        return None


def plan_tools(body: ChatCompletionRequest, parsing: ChatParsing) -> ToolPlan:
    """The request's tool use, or a 400 naming the field that cannot be served."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools: the request gives none", "tool_choice")
        return ToolPlan("none", [])
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same function name", "tools")
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice is None or choice == "auto":
        if not (parsing.enable_auto_tool_choice and parsing.tool_parser is not None):
            implied = f" (this model's template implies {parsing.tool_parser_name})" if parsing.tool_parser else ""
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                           f"--enable-auto-tool-choice and a tool parser{implied}; or send tool_choice "
                           '"required", "none" or a named function', "tool_choice")
        return ToolPlan("auto", tools, max_calls=max_calls)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        try:
            schema = required_schema(tools, parallel_tool_calls=max_calls is None)
        except ValueError as exc:
            raise APIError(400, str(exc), "tools") from None
        return ToolPlan("required", tools, schema, max_calls=max_calls)
    name = choice.function.name
    try:
        schema = named_schema(tools, name)
    except KeyError:
        raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})",
                       "tool_choice") from None
    return ToolPlan("named", tools, schema, function=name)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: an assistant turn's `tool_calls` with `arguments` as a
    dict (Hugging Face templates render it with `tojson`, as vLLM hands it over), a tool turn's `tool_call_id`."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                               "messages")
            calls = []
            for call in m.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    raise APIError(400, f"messages[{i}].tool_calls: arguments of {call.function.name!r} are not "
                                   "JSON", "messages") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id", "messages")
            msg["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise APIError(400, f"messages[{i}].tool_call_id: only tool messages answer a call", "messages")
        out.append(msg)
    return out
