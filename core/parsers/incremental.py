"""Base classes deriving a parser's streaming deltas from the same prefix parse that gives its whole result.

A subclass writes one function, `parse_prefix(text, final)`: what the output so far says for sure. The base
class answers the whole-output method from it (final=True) and, while streaming, sends what the prefix parse
adds to what was already sent. So the streamed deltas concatenate to the whole result by construction, as
long as `parse_prefix` is monotone: on a longer text, content, reasoning and each call's arguments only grow.

NOTE: 1. Text that might open a marker (`<tool_c` of `<tool_call>`) is held back until it can be told apart.
2. Trailing whitespace of content is held back too: before a tool call it is dropped (the whole result strips
it), so sending it early would make the stream disagree. 3. A malformed call (arguments that do not parse)
makes the whole result fall back to plain content, as vLLM's parsers do; a stream that already sent the call's
name cannot take it back, so there the two differ, and only there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedllm.parsers.json_scan import ObjectScan, member, partial_suffix, scan_object, skip_ws
from pagedllm.parsers.messages import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    new_tool_call_id,
)

NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class PartialToolCall:
    """A call as far as the text goes: `name` once its string is complete, `arguments` the raw JSON so far."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class ToolPrefix:
    """What a prefix of the output says: the content outside calls, and the calls begun (in order)."""

    content: str
    calls: list[PartialToolCall] = field(default_factory=list)
    valid: bool = True  # False: the text cannot be tool calls (the whole result is then plain content)


def scan_call_objects(text: str, i: int, calls: list[PartialToolCall]) -> list[PartialToolCall]:
    """Append to `calls` (and return it) the calls of a JSON array's `{...}` elements from `i` (just after its
    `[`), the last one possibly still arriving. Raises JSONScanError where the text is not JSON, with the calls
    before that point already in `calls`."""
    i = skip_ws(text, i)
    while i < len(text) and text[i] == "{":
        scan = scan_object(text, i)
        calls.append(call_from_object(text, scan))
        if not scan.complete:
            break
        i = skip_ws(text, scan.end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
    return calls


def call_from_object(text: str, scan: ObjectScan, name_keys: tuple[str, ...] = NAME_KEYS,
                     argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> PartialToolCall:
    """The call an object like `{"name": "f", "arguments": {...}}` gives, complete or not."""
    name_member = member(scan, name_keys)
    name: str | None = None
    if name_member is not None and name_member.complete:
        value = json.loads(text[name_member.start:name_member.end])
        name = value if isinstance(value, str) else None
    args = member(scan, argument_keys)
    # A complete call without arguments takes none.
    arguments = text[args.start:args.end] if args is not None else ("{}" if scan.complete else "")
    return PartialToolCall(name, arguments, scan.complete)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class IncrementalToolParser:
    """A tool parser (pagedllm.protocols.tool_parser.ToolParser) written as one `parse_prefix`."""

    # Whether the markers this parser looks for are special tokens the detokenizer would otherwise drop.
    keep_special_tokens: ClassVar[bool] = False

    def __init__(self, context: Any = None) -> None:
        self.context = context
        self._content_sent = ""
        self._calls_sent: list[list[Any]] = []  # per call: [id, arguments chars sent]

    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        """What `text` (the output so far; all of it when `final`) says for sure."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        prefix = self.parse_prefix(model_output, final=True)
        calls = prefix.calls
        if (not prefix.valid or not calls
                or any(c.name is None or not c.complete or not _is_json_object(c.arguments) for c in calls)):
            return ExtractedToolCalls(False, [], model_output or None)
        content = prefix.content.rstrip() or None
        return ExtractedToolCalls(True, [ToolCall(str(c.name), c.arguments) for c in calls], content)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        if finished:
            whole = self.extract_tool_calls(current_text)
            if whole.tools_called or not self._calls_sent:
                content = whole.content or ""
                calls = [PartialToolCall(c.name, c.arguments, True) for c in whole.tool_calls]
            else:  # NOTE 3: calls already went out; finish them as parsed
                prefix = self.parse_prefix(current_text, final=True)
                content, calls = prefix.content.rstrip(), prefix.calls
        else:
            prefix = self.parse_prefix(current_text, final=False)
            content, calls = prefix.content.rstrip(), prefix.calls  # NOTE 2
        delta = DeltaMessage()
        if len(content) > len(self._content_sent) and content.startswith(self._content_sent):
            delta.content = content[len(self._content_sent):]
            self._content_sent = content
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self._calls_sent):
                call_id = new_tool_call_id()
                self._calls_sent.append([call_id, 0])
                delta.tool_calls.append(ToolCallDelta(index, id=call_id, type="function", name=call.name,
                                                      arguments=""))
            sent = self._calls_sent[index][1]
            if len(call.arguments) > sent:
                delta.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[sent:]))
                self._calls_sent[index][1] = len(call.arguments)
        return None if delta.is_empty() else delta


@dataclass
class ReasoningPrefix:
    reasoning: str
    content: str


class IncrementalReasoningParser:
    """A reasoning parser (pagedllm.protocols.reasoning_parser.ReasoningParser) written as one `parse_prefix`."""

    def __init__(self, context: Any = None) -> None:
        self.context = context
        self._reasoning_sent = ""
        self._content_sent = ""

    def parse_prefix(self, text: str, final: bool) -> ReasoningPrefix:
        raise NotImplementedError

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        prefix = self.parse_prefix(model_output, final=True)
        return prefix.reasoning or None, prefix.content or None

    def extract_reasoning_content_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        prefix = self.parse_prefix(current_text, final=finished)
        delta = DeltaMessage()
        if len(prefix.reasoning) > len(self._reasoning_sent) and prefix.reasoning.startswith(self._reasoning_sent):
            delta.reasoning_content = prefix.reasoning[len(self._reasoning_sent):]
            self._reasoning_sent = prefix.reasoning
        if len(prefix.content) > len(self._content_sent) and prefix.content.startswith(self._content_sent):
            delta.content = prefix.content[len(self._content_sent):]
            self._content_sent = prefix.content
        return None if delta.is_empty() else delta


class ThinkTagReasoningParser(IncrementalReasoningParser):
    """`<think>reasoning</think>content`, the DeepSeek-R1 / Qwen3 shape.

    `start_optional`: the chat template may already have opened `<think>` in the prompt (DeepSeek-R1's newer
    templates do), so text before `</think>` is reasoning even without a start tag, and an output that never
    closes it is all reasoning. Otherwise (Qwen3) an output not starting with `<think>` is all content.
    """

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    start_optional: ClassVar[bool] = False

    def parse_prefix(self, text: str, final: bool) -> ReasoningPrefix:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and self.start_tag.startswith(body):
            return ReasoningPrefix("", "")  # might still become the start tag
        elif not self.start_optional:
            return ReasoningPrefix("", text)
        end = body.find(self.end_tag)
        if end >= 0:
            return ReasoningPrefix(body[:end], body[end + len(self.end_tag):])
        hold = 0 if final else partial_suffix(body, self.end_tag)
        return ReasoningPrefix(body[:len(body) - hold], "")
