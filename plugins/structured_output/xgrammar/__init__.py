"""Registers the `xgrammar` structured-output backend (the default): JSON schema, regex, choice, EBNF, structural tags."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterStructuredOutputBackend, StructuredOutputCheckContext, hookimpl


def _load() -> Any:
    from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarBackend

    return XgrammarBackend


def _check(params: StructuredOutputCheckContext) -> list[str]:
    # Only what xgrammar cannot do at all; whether this schema or grammar parses is validate()'s to say, with
    # the error, so a typo is a 400 and not a silent switch to another backend. Imported here only when a
    # request asks (never at registration), and only if installed (`requires` is checked first).
    from pagedllm.plugins.structured_output.xgrammar.backend import unsupported

    return unsupported(params)


@hookimpl
def register_structured_output_backends(register: RegisterStructuredOutputBackend) -> None:
    register(
        "xgrammar",
        _load,
        priority=100,
        requires=("xgrammar",),
        check=_check,
        description="xgrammar (pip install xgrammar): JSON schema, regex, choice, EBNF/GBNF, structural tags",
    )
