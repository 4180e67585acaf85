"""Registers the `draft` proposer: a smaller model sharing the tokenizer, with its own paged KV cache."""

from __future__ import annotations

from typing import Any

from pagedllm.api import ProposerCheckContext, RegisterProposer, hookimpl


def _load() -> Any:
    from pagedllm.plugins.proposers.draft.proposer import DraftModelProposer

    return DraftModelProposer


def _check(spec: ProposerCheckContext) -> list[str]:
    """The draft model must be named (speculative.draft_model); everything else is checked when building."""
    if not getattr(spec, "draft_model", None):
        return ["speculative.draft_model is not set (the folder of a smaller model sharing the tokenizer)"]
    return []


@hookimpl
def register_proposers(register: RegisterProposer) -> None:
    register(
        "draft",
        _load,
        check=_check,
        description="a smaller model (speculative.draft_model) proposes k tokens autoregressively",
    )
