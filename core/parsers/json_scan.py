"""A scanner for JSON text that may still be arriving: where each value starts and ends, and whether it has.

Tool parsers stream a call's `arguments` as the raw text of its JSON value, cut from the model's output: the
text a longer prefix gives always extends the text a shorter one gave, so the streamed fragments concatenate
to exactly the whole result (no re-serialising, whose spacing could differ between the two). The scanner
never decodes what it does not need to; only keys and the `name` string are decoded, once complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


class JSONScanError(ValueError):
    """The text is not JSON (as opposed to JSON cut short)."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_value(text: str, i: int) -> tuple[int, bool]:
    """(end, complete) of the JSON value starting at text[i] (not whitespace).

    While incomplete, end is len(text). A number or literal touching the end of the text counts as
    incomplete: more digits may follow.
    """
    if i >= len(text):
        return len(text), False
    ch = text[i]
    if ch == '"':
        return _scan_string(text, i)
    if ch in _CLOSE:
        stack = [_CLOSE[ch]]
        j = i + 1
        while j < len(text):
            c = text[j]
            if c == '"':
                j, done = _scan_string(text, j)
                if not done:
                    return len(text), False
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                if c != stack.pop():
                    raise JSONScanError(f"unbalanced {c!r} at {j}")
                if not stack:
                    return j + 1, True
            j += 1
        return len(text), False
    if ch == "-" or ch.isdigit() or ch in "tfn":
        j = i
        while j < len(text) and text[j] not in _WS + ",]}":
            j += 1
        if j == len(text):
            return j, False
        _check_scalar(text[i:j], i)
        return j, True
    raise JSONScanError(f"unexpected {ch!r} at {i}")


def _scan_string(text: str, i: int) -> tuple[int, bool]:
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1, True
        j += 1
    return len(text), False


def _check_scalar(raw: str, at: int) -> None:
    try:
        json.loads(raw)
    except ValueError:
        raise JSONScanError(f"not a JSON value at {at}: {raw[:20]!r}") from None


@dataclass
class Member:
    """One `"key": value` of an object: the value's raw text is text[start:end]."""

    key: str
    start: int
    end: int
    complete: bool


@dataclass
class ObjectScan:
    members: list[Member]
    complete: bool
    end: int  # one past the closing brace when complete, else len(text)


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object starting at text[i] == "{", as far as the text goes.

    A member appears once its key is complete and its value has started.
    """
    if i >= len(text) or text[i] != "{":
        raise JSONScanError(f"expected '{{' at {i}")
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan(members, True, j + 1)
    while j < len(text):
        if text[j] != '"':
            raise JSONScanError(f"expected a key at {j}")
        key_end, done = _scan_string(text, j)
        if not done:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise JSONScanError(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end, complete = scan_value(text, j)
        members.append(Member(key, j, end, complete))
        if not complete:
            break
        j = skip_ws(text, end)
        if j >= len(text):
            break
        if text[j] == "}":
            return ObjectScan(members, True, j + 1)
        if text[j] != ",":
            raise JSONScanError(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return ObjectScan(members, False, len(text))


def member(scan: ObjectScan, keys: tuple[str, ...]) -> Member | None:
    """The first member named by one of `keys` (in `keys` order)."""
    for key in keys:
        for m in scan.members:
            if m.key == key:
                return m
    return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`: text a streaming parser must hold back."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
