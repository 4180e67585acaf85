"""Plugin API versions: which `pagedllm.api.API_VERSION` a plugin module says it supports.

A plugin module declares `PAGEDLLM_PLUGIN_API = ">=1,<2"`: comma-separated clauses of `==`, `!=`, `>=`, `>`,
`<=`, `<` and a version; a bare version means `==`. A version is an integer, compared with the API's major
(`PLUGIN_API_VERSION`) only, or dotted (`1.1`, `1.1.0`), compared as a tuple of integers with the whole
`API_VERSION`, the shorter one padded with zeros (`==1.1` is `==1.1.0`). So ">=1,<2" accepts every 1.x and
">=1.2,<2" needs 1.2.0 or later. A module that declares nothing is taken to support every version (in-tree
plugins and plugins written before versioning). Integers only, no pre-releases: no `packaging` dependency.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

ATTRIBUTE = "PAGEDLLM_PLUGIN_API"

Version = tuple[int, ...]

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}
_CLAUSE = re.compile(r"^\s*(==|!=|>=|<=|>|<)?\s*(\d+(?:\.\d+)*)\s*$")


def parse_range(spec: Any) -> list[tuple[str, int | Version]]:
    """Parse a declared range into (operator, version) clauses; ValueError naming the bad clause.

    An integer clause gives an int (a major), a dotted one a tuple of ints.
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        return [("==", spec)]
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{ATTRIBUTE} must be a string like '>=1,<2' or an int, not {spec!r}")
    clauses: list[tuple[str, int | Version]] = []
    for part in spec.split(","):
        match = _CLAUSE.match(part)
        if match is None:
            raise ValueError(
                f"{ATTRIBUTE} clause {part.strip()!r} in {spec!r} is not '<op><version>' "
                "(an integer major or a dotted version such as 1.1)"
            )
        text = match.group(2)
        version: int | Version = tuple(int(p) for p in text.split(".")) if "." in text else int(text)
        clauses.append((match.group(1) or "==", version))
    return clauses


def parse_version(version: int | str) -> Version:
    """`"1.1.0"` -> (1, 1, 0); an int is a major alone (1 -> (1,), i.e. 1.0.0 against a dotted clause)."""
    if isinstance(version, int):
        return (version,)
    return tuple(int(p) for p in version.split("."))


def satisfies(current: int | str, op: str, version: int | Version) -> bool:
    """Whether API version `current` satisfies one clause: an int clause compares majors, a dotted one tuples."""
    have = parse_version(current)
    if isinstance(version, int):
        return _OPS[op](have[0], version)
    width = max(len(have), len(version))
    return _OPS[op](_pad(have, width), _pad(version, width))


def incompatibility(module: Any, current: int | str) -> str | None:
    """Why `module` cannot run on plugin API `current` (None: it can, or it declares nothing).

    `current` is the API version: `API_VERSION` ("1.1.0"), or an int major (then taken as N.0.0 by dotted
    clauses).
    """
    spec = getattr(module, ATTRIBUTE, None)
    if spec is None:
        return None
    try:
        clauses = parse_range(spec)
    except ValueError as exc:
        return str(exc)
    if all(satisfies(current, op, version) for op, version in clauses):
        return None
    return f"supports pagedllm plugin API {spec!r} but this pagedllm provides plugin API {current}"


def _pad(version: Version, width: int) -> Version:
    return version + (0,) * (width - len(version))
