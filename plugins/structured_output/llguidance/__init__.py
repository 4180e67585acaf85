"""Registers the `llguidance` structured-output backend: JSON schema, regex, choice, Lark and GBNF grammars."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterStructuredOutputBackend, StructuredOutputCheckContext, hookimpl


def _load() -> Any:
    from pagedllm.plugins.structured_output.llguidance.backend import LLGuidanceBackend

    return LLGuidanceBackend


def _check(params: StructuredOutputCheckContext) -> list[str]:
    if params.structural_tag is not None:
        return ["llguidance here takes no structural_tag (xgrammar does)"]
    return []


@hookimpl
def register_structured_output_backends(register: RegisterStructuredOutputBackend) -> None:
    register(
        "llguidance",
        _load,
        priority=50,
        requires=("llguidance",),
        check=_check,
        description="llguidance (pip install llguidance): JSON schema, regex, choice, Lark and GBNF grammars",
    )
