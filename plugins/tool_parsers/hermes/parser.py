"""Hermes-style tool calls (NousResearch Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates).

    I'll look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of blocks; the text outside them is content. vLLM's `Hermes2ProToolParser` reads the same text.
"""

from __future__ import annotations

from typing import ClassVar

from pagedllm.api.parsers import (
    IncrementalToolParser,
    JSONScanError,
    PartialToolCall,
    ToolPrefix,
    call_from_object,
    partial_suffix,
    scan_object,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(IncrementalToolParser):
    # Qwen2.5 / Qwen3 tokenizers keep <tool_call> in decoded text (an added token, not a special one).
    # NOTE: Hermes 2 Pro marks it special: serve it with skip_special_tokens=false in the request.
    keep_special_tokens: ClassVar[bool] = False

    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        content: list[str] = []
        calls: list[PartialToolCall] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - partial_suffix(tail, OPEN)])
                break
            content.append(text[pos:start])
            i = skip_ws(text, start + len(OPEN))
            if i == len(text):
                calls.append(PartialToolCall(None, "", False))
                break
            try:
                scan = scan_object(text, i)
            except JSONScanError:
                return ToolPrefix("".join(content), calls, valid=False)
            calls.append(call_from_object(text, scan))
            if not scan.complete:
                break
            close = text.find(CLOSE, scan.end)
            if close < 0:
                # The closing tag is still to come (or, at the end, was cut off: the call stands on its own).
                if text[scan.end:].strip() and not CLOSE.startswith(text[scan.end:].strip()):
                    return ToolPrefix("".join(content), calls, valid=False)
                break
            if text[scan.end:close].strip():
                return ToolPrefix("".join(content), calls, valid=False)
            pos = close + len(CLOSE)
        return ToolPrefix("".join(content), calls)
