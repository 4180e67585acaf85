"""Pythonic tool calls (Llama 3.2 and Llama 4 templates, ToolACE): the output is a Python list of calls.

    [get_weather(city="Paris", unit="celsius"), get_time(zone='UTC')]

Keyword arguments only, each value a Python literal (strings, numbers, True/False/None, lists, dicts); the
arguments become a JSON object. `<|python_start|>` / `<|python_end|>` around the list are allowed. An output
that does not start with `[` is all content. A call's arguments are sent whole once its `)` arrives: a
literal's JSON form is only known when it is complete, and the name goes with them. vLLM's `PythonicToolParser` reads the same text.
"""

from __future__ import annotations

import ast
import json
import re

from pagedllm.api.parsers import IncrementalToolParser, PartialToolCall, ToolPrefix, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_PAIRS = {"(": ")", "[": "]", "{": "}"}


class _Malformed(ValueError):
    pass


def _scan_call(text: str, i: int) -> int | None:
    """One past the `)` closing the call whose `(` is text[i], or None while the text ends first."""
    stack: list[str] = []
    j = i
    while j < len(text):
        c = text[j]
        if c in "'\"":
            quote = text[j:j + 3] if text[j:j + 3] in ('"""', "'''") else c
            j += len(quote)
            while j < len(text) and not text.startswith(quote, j):
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return None
            j += len(quote)
            continue
        if c in _PAIRS:
            stack.append(_PAIRS[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                raise _Malformed(f"unbalanced {c!r}")
            if not stack:
                return j + 1
        j += 1
    return None


def _arguments(call_text: str) -> str:
    """The JSON object of a call's keyword arguments."""
    try:
        node = ast.parse(call_text, mode="eval").body
    except SyntaxError as exc:
        raise _Malformed(str(exc)) from None
    if not isinstance(node, ast.Call) or node.args:
        raise _Malformed("a call takes keyword arguments only")
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise _Malformed("**kwargs is not a tool call")
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            raise _Malformed(f"argument {kw.arg} is not a literal") from None
    return json.dumps(kwargs, ensure_ascii=False)


class PythonicToolParser(IncrementalToolParser):
    def parse_prefix(self, text: str, final: bool) -> ToolPrefix:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or (START.startswith(rest) and rest != START)):
            return ToolPrefix("")
        if rest.startswith(START):
            i = skip_ws(text, i + len(START))
        if i == len(text):
            return ToolPrefix("" if not final else text, valid=not final)
        if text[i] != "[":
            return ToolPrefix(text, valid=False)
        calls: list[PartialToolCall] = []
        i = skip_ws(text, i + 1)
        try:
            while i < len(text):
                m = _NAME.match(text, i)
                if m is None:
                    break
                paren = skip_ws(text, m.end())
                if paren == len(text):
                    break  # the name may go on
                if text[paren] != "(":
                    raise _Malformed(f"expected '(' after {m.group()}")
                end = _scan_call(text, paren)
                if end is None:
                    # NOTE: the name waits for the arguments: a call whose literals do not parse is content
                    # in the whole result, and a name already streamed could not be taken back.
                    calls.append(PartialToolCall(None, "", False))
                    return ToolPrefix("", calls)
                calls.append(PartialToolCall(m.group(), _arguments(text[i:end]), True))
                i = skip_ws(text, end)
                if i < len(text) and text[i] == ",":
                    i = skip_ws(text, i + 1)
                elif i < len(text) and text[i] == "]":
                    tail = text[i + 1:].strip()
                    if tail.startswith(END):
                        tail = tail[len(END):].strip()
                    elif not final and END.startswith(tail):
                        tail = ""  # maybe the end tag, still arriving
                    return ToolPrefix(tail, calls)
                elif i < len(text):
                    raise _Malformed("expected ',' or ']' between calls")
        except _Malformed:
            return ToolPrefix("", calls, valid=False)
        return ToolPrefix("", calls, valid=not final)
