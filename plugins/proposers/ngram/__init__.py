"""Registers the `ngram` proposer: prompt lookup, copying what followed the last n tokens earlier on."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterProposer, hookimpl


def _load() -> Any:
    from pagedllm.plugins.proposers.ngram.proposer import NgramProposer

    return NgramProposer


@hookimpl
def register_proposers(register: RegisterProposer) -> None:
    register(
        "ngram",
        _load,
        description="prompt lookup: the tokens that followed the context's last n-gram where it occurred before",
    )
