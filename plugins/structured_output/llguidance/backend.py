"""LLGuidanceBackend: constraints as llguidance grammars; one LLMatcher per request.

NOTE(1) llguidance builds its lexer and parser when a matcher is made, and computes masks lazily as it goes.
`compile` makes one matcher (the cached result) and every request starts from a deep copy of it, so the
grammar is built once per constraint, not once per request.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from pagedllm.api.structured_output import (
    StructuredOutputContext,
    StructuredOutputsParams,
    choice_as_lark,
    json_schema,
)


def _serialize(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text for `params`; ValueError names the field."""
    kind = params.kind
    field = f"structured_outputs.{kind}"
    try:
        if kind in ("json", "json_object"):
            defaults: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                defaults["whitespace_pattern"] = params.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_schema(params)), defaults=defaults)
        if kind == "regex":
            assert params.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return llguidance.LLMatcher.grammar_from_lark(choice_as_lark(params.choice))
        if kind == "grammar":
            assert params.grammar is not None
            return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        if str(exc).startswith("structured_outputs."):
            raise
        raise ValueError(f"{field}: {exc}") from None
    except Exception as exc:
        raise ValueError(f"{field}: {exc}") from None
    raise ValueError(f"{field}: not supported by llguidance")


def _check_grammar(params: StructuredOutputsParams, grammar: str, tokenizer: Any = None) -> None:
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"structured_outputs.{params.kind}: {error.strip()}")


class LLGuidanceGrammar:
    """One request's matcher (pagedllm.api.structured_output.StructuredOutputGrammar).

    NOTE(2) llguidance stops a matcher as soon as nothing but EOS can follow, before the EOS is sampled, and
    then consumes no more tokens. The request is not over until its EOS is accepted, so termination is tracked
    here (as vLLM's guidance backend does), and an EOS accepted while stopped is remembered as not consumed,
    so that rolling it back does not roll back a real token.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos = eos_token_ids
        self._terminated = False
        self._unconsumed = 0  # accepted EOS tokens the stopped matcher did not consume

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self._terminated:
                return True  # past the end: the scheduler drops what follows a stop
            if self.matcher.is_stopped():
                if token not in self.eos:
                    return False
                self._unconsumed += 1
                self._terminated = True
                continue
            if not self.matcher.consume_token(token):
                return False
            self._terminated = token in self.eos
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        if self._terminated or not tokens:
            return []
        if self.matcher.is_stopped():
            return tokens[:1] if tokens[0] in self.eos else []
        return tokens[: self.matcher.validate_tokens(tokens)]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        unconsumed = min(num_tokens, self._unconsumed)
        self._unconsumed -= unconsumed
        if num_tokens > unconsumed:
            self.matcher.rollback(num_tokens - unconsumed)
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, index)  # EOS only, once stopped

    def is_terminated(self) -> bool:
        return self._terminated


class LLGuidanceBackend:
    """pagedllm.api.structured_output.StructuredOutputBackend over llguidance."""

    def __init__(self, ctx: StructuredOutputContext) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(ctx.tokenizer, n_vocab=ctx.vocab_size,
                                                      eos_token=list(ctx.eos_token_ids) or None)
        self.eos = frozenset(ctx.eos_token_ids)

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        if params.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag: not supported by llguidance (use xgrammar)")
        _check_grammar(params, _serialize(params))

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, never advanced: each request's is a deep copy (NOTE 1)."""
        grammar = _serialize(params)
        _check_grammar(params, grammar, self.tokenizer)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=1)
        error = matcher.get_error()
        if error:
            raise ValueError(f"structured_outputs.{params.kind}: {error}")
        return matcher

    def make_grammar(self, compiled: llguidance.LLMatcher) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(compiled.deep_copy(), self.eos)
