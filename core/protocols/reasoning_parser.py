"""Reasoning-parser protocol: splits a reasoning model's text into `reasoning_content` and `content`.

Modeled on vLLM's ReasoningParser (vllm/reasoning/abs_reasoning_parsers.py), by text. Light (no torch): the
API process builds one parser per chat request, `cls(ReasoningParserContext)`; a parser is stateful while
streaming. The reasoning and content a stream returns must concatenate to what the whole-output method
gives (`pagedllm.testing.check_reasoning_parser` checks it at every split point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.parsers.messages import DeltaMessage


@dataclass(frozen=True)
class ReasoningParserContext:
    """What a reasoning parser is built with: the model's tokenizer (None when it has none)."""

    tokenizer: Any


class ReasoningParser(Protocol):
    """What a reasoning-parser registration's `load()` returns: a class built as `cls(ReasoningParserContext)`."""

    def extract_reasoning_content(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is empty."""
        ...

    def extract_reasoning_content_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        """What this step adds to `reasoning_content` and `content` (None: nothing yet).

        `current_text` is the output so far; `finished` is True on the request's last call.
        """
        ...
