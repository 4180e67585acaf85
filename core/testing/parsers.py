"""Conformance checks for tool-call and reasoning parsers: right on whole outputs, and streams that agree.

    from pagedllm.testing import ToolParserCase, check_tool_parser
    check_tool_parser("my_parser", [ToolParserCase('<call>{"name": "f", "arguments": {}}</call>',
                                                   calls=[("f", {})])])

Each case is a realistic model output and what it should give. The check builds the parser through the plugin
manager, parses the whole output, then streams the same text split at every character boundary (two
pieces), one character at a time, and in one piece, and asserts the streamed deltas reassemble to exactly the
whole result: content, each call's name and its `arguments` text, character for character, with OpenAI's
chunk shape (a call's first delta carries its id and name, later ones only arguments; indices count from 0).
Plain text with no call is always among the cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.testing.components import find_spec

PLAIN_TEXT = "The capital of France is Paris. {Braces} and [brackets] are plain text here."


@dataclass(frozen=True)
class ToolParserCase:
    """An output and what it holds: `calls` as (name, arguments object), None for "no call, all content"."""

    text: str
    calls: list[tuple[str, dict[str, Any]]] | None = None
    content: str | None = None  # expected content when calls are made (None: no content)


@dataclass(frozen=True)
class ReasoningParserCase:
    text: str
    reasoning: str | None
    content: str | None


@dataclass
class ParserReport:
    name: str
    cases: int = 0
    streams: int = 0  # streamed splits checked, over all cases
    failures: list[str] = field(default_factory=list)


def _splits(text: str) -> list[list[str]]:
    """Every two-piece split, one character at a time, and the whole text at once."""
    out = [[text[:k], text[k:]] for k in range(1, len(text))]
    out.append(list(text))
    out.append([text])
    return out


def _stream_tool_calls(cls: Any, context: Any, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    parser = cls(context)
    previous, content = "", []
    calls: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(previous, current, piece, finished=k == len(pieces) - 1)
        previous = current
        if delta is None:
            continue
        content.append(delta.content or "")
        for d in delta.tool_calls:
            if d.index == len(calls):
                assert d.id and d.name, f"call {d.index}'s first delta must carry its id and name: {d}"
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments or ""})
            else:
                assert d.index < len(calls), f"delta for call {d.index} before call {len(calls)} began"
                assert d.id is None and d.name is None, f"a later delta of call {d.index} repeats id or name"
                calls[d.index]["arguments"] += d.arguments or ""
    return "".join(content), calls


def check_tool_parser(name: str, cases: list[ToolParserCase], tools: list[dict[str, Any]] | None = None,
                      pm: Any = None) -> ParserReport:
    """Run every case through the registered tool parser `name`; AssertionError naming the first failure."""
    from pagedllm.parsers.messages import ExtractedToolCalls
    from pagedllm.plugin_spec import PluginKind
    from pagedllm.protocols.tool_parser import ToolParserContext

    cls = find_spec(PluginKind.TOOL_PARSER, name, pm).resolve()
    context = ToolParserContext(tokenizer=None, tools=list(tools or []))
    report = ParserReport(name)
    for case in [ToolParserCase(PLAIN_TEXT), *cases]:
        whole = cls(context).extract_tool_calls(case.text)
        assert isinstance(whole, ExtractedToolCalls), f"{name}: extract_tool_calls returned {whole!r}"
        got = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
        if case.calls is None:
            assert not whole.tools_called and whole.content == (case.text or None), (
                f"{name}: {case.text!r} holds no call, but parsed as {got}, content {whole.content!r}")
        else:
            assert whole.tools_called and got == case.calls, f"{name}: {case.text!r} gave {got}, not {case.calls}"
            assert whole.content == case.content, f"{name}: {case.text!r} content {whole.content!r}"
        expected_calls = [(c.name, c.arguments) for c in whole.tool_calls]
        for pieces in _splits(case.text):
            content, calls = _stream_tool_calls(cls, context, pieces)
            where = f"{name}: {case.text!r} streamed as {pieces[:3]}{'...' if len(pieces) > 3 else ''}"
            assert content == (whole.content or ""), f"{where}: content {content!r} != {whole.content!r}"
            assert [(c["name"], c["arguments"]) for c in calls] == expected_calls, (
                f"{where}: calls {calls} != {expected_calls}")
            report.streams += 1
        report.cases += 1
    return report


def _stream_reasoning(cls: Any, context: Any, pieces: list[str]) -> tuple[str, str]:
    parser = cls(context)
    previous, reasoning, content = "", [], []
    for k, piece in enumerate(pieces):
        current = previous + piece
        delta = parser.extract_reasoning_content_streaming(previous, current, piece, finished=k == len(pieces) - 1)
        previous = current
        if delta is not None:
            reasoning.append(delta.reasoning_content or "")
            content.append(delta.content or "")
    return "".join(reasoning), "".join(content)


def check_reasoning_parser(name: str, cases: list[ReasoningParserCase], pm: Any = None) -> ParserReport:
    """Run every case through the registered reasoning parser `name`, whole and streamed at every split."""
    from pagedllm.plugin_spec import PluginKind
    from pagedllm.protocols.reasoning_parser import ReasoningParserContext

    cls = find_spec(PluginKind.REASONING_PARSER, name, pm).resolve()
    context = ReasoningParserContext(tokenizer=None)
    report = ParserReport(name)
    for case in cases:
        reasoning, content = cls(context).extract_reasoning_content(case.text)
        assert (reasoning, content) == (case.reasoning, case.content), (
            f"{name}: {case.text!r} gave reasoning {reasoning!r}, content {content!r}; "
            f"expected {case.reasoning!r}, {case.content!r}")
        for pieces in _splits(case.text):
            streamed = _stream_reasoning(cls, context, pieces)
            assert streamed == (reasoning or "", content or ""), (
                f"{name}: {case.text!r} streamed as {pieces[:3]}... gave {streamed}")
            report.streams += 1
        report.cases += 1
    return report
