"""Mistral tool calls, in both of Mistral's formats.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ..., "arguments": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is the tokenizer versions before v11 (Mistral 7B v0.3, Mixtral, Nemo), the second v11 on (Mistral
Small 3.2, Magistral). Text before the first `[TOOL_CALLS]` is content. `[TOOL_CALLS]` is a special token, so
the server keeps special tokens for requests with tools. vLLM's `MistralToolParser` reads the same text.
"""

from __future__ import annotations

import re
from typing import ClassVar

from pagedllm.api.parsers import (
    IncrementalToolParser,
    JSONScanError,
    PartialToolCall,
    ToolPrefix,
    partial_suffix,
    scan_call_objects,
    scan_value,
    skip_ws,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(IncrementalToolParser):
    keep_special_tokens: ClassVar[bool] = True

    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        start = text.find(BOT)
        if start < 0:
            return ToolPrefix(text if final else text[:len(text) - partial_suffix(text, BOT)])
        content = text[:start]
        i = skip_ws(text, start + len(BOT))
        if i == len(text):
            return ToolPrefix(content, [PartialToolCall(None, "", False)], valid=not final)
        try:
            if text[i] == "[":
                return self._json_array(text, i, content)
            return self._name_args(text, start, content, final)
        except JSONScanError:
            return ToolPrefix(content, valid=False)

    def _json_array(self, text: str, i: int, content: str) -> ToolPrefix:
        return ToolPrefix(content, scan_call_objects(text, i + 1, []))

    def _name_args(self, text: str, start: int, content: str, final: bool) -> ToolPrefix:
        calls: list[PartialToolCall] = []
        pos = start
        while pos < len(text) and text.startswith(BOT, pos):
            name_end = text.find(ARGS, pos + len(BOT))
            if name_end < 0:
                calls.append(PartialToolCall(None, "", False))
                return ToolPrefix(content, calls, valid=not final)
            name = text[pos + len(BOT):name_end].strip()
            if not _NAME.fullmatch(name):
                return ToolPrefix(content, calls, valid=False)
            i = skip_ws(text, name_end + len(ARGS))
            if i == len(text):
                calls.append(PartialToolCall(name, "", False))
                break
            end, complete = scan_value(text, i)
            calls.append(PartialToolCall(name, text[i:end], complete))
            if not complete:
                break
            pos = skip_ws(text, end)
        else:
            if pos < len(text) and not (not final and BOT.startswith(text[pos:])):
                return ToolPrefix(content, calls, valid=False)  # text after the calls is not Mistral's format
        return ToolPrefix(content, calls)
