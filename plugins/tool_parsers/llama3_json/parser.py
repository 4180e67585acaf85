"""Llama 3.1-3.3 JSON tool calls (the "JSON based tool calling" of Meta's prompt format).

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

The output is calls only when it starts with `{` (after an optional `<|python_tag|>`); then one or more
objects separated by `;`, and text after them is content. Any other output is all content. vLLM's
`Llama3JsonToolParser` reads the same text.
"""

from __future__ import annotations

from pagedllm.api.parsers import (
    IncrementalToolParser,
    JSONScanError,
    PartialToolCall,
    ToolPrefix,
    call_from_object,
    scan_object,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(IncrementalToolParser):
    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
            return ToolPrefix("")  # nothing yet, or maybe the python tag: cannot tell calls from content
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        if i == len(text) or text[i] != "{":
            return ToolPrefix(text if final or i < len(text) else "", valid=False)
        calls: list[PartialToolCall] = []
        try:
            while True:
                scan = scan_object(text, i)
                calls.append(call_from_object(text, scan))
                if not scan.complete:
                    return ToolPrefix("", calls)
                i = skip_ws(text, scan.end)
                if i < len(text) and text[i] == ";":
                    i = skip_ws(text, i + 1)
                    if i == len(text) or text[i] == "{":
                        if i == len(text):
                            return ToolPrefix("", calls)
                        continue
                return ToolPrefix(text[i:], calls)
        except JSONScanError:
            return ToolPrefix("", calls, valid=False)
