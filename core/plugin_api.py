"""Plugin API versions: which `pagedllm.PLUGIN_API_VERSION` a plugin module says it supports.

A plugin module declares `PAGEDLLM_PLUGIN_API = ">=1,<2"` (comma-separated clauses of `==`, `!=`, `>=`, `>`,
`<=`, `<` and an integer; a bare integer means `==`). A module that declares nothing is taken to support
every version (in-tree plugins and plugins written before versioning). Integers only: the API version is one
number, bumped on a breaking protocol change, so no `packaging` dependency is needed to compare it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

ATTRIBUTE = "PAGEDLLM_PLUGIN_API"

_OPS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
_CLAUSE = re.compile(r"^\s*(==|!=|>=|<=|>|<)?\s*(\d+)\s*$")


def parse_range(spec: Any) -> list[tuple[str, int]]:
    """Parse a declared range into (operator, version) clauses; ValueError naming the bad clause."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return [("==", spec)]
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{ATTRIBUTE} must be a string like '>=1,<2' or an int, not {spec!r}")
    clauses = []
    for part in spec.split(","):
        match = _CLAUSE.match(part)
        if match is None:
            raise ValueError(f"{ATTRIBUTE} clause {part.strip()!r} in {spec!r} is not '<op><integer>'")
        clauses.append((match.group(1) or "==", int(match.group(2))))
    return clauses


def incompatibility(module: Any, current: int) -> str | None:
    """Why `module` cannot run on plugin API `current` (None: it can, or it declares nothing)."""
    spec = getattr(module, ATTRIBUTE, None)
    if spec is None:
        return None
    try:
        clauses = parse_range(spec)
    except ValueError as exc:
        return str(exc)
    if all(_OPS[op](current, version) for op, version in clauses):
        return None
    return f"supports pagedllm plugin API {spec!r} but this pagedllm provides plugin API {current}"
