"""Structured-output protocol: a backend compiles a constraint into grammars that mask each step's logits.

Modelled on vLLM's `vllm/v1/structured_output/backend_types.py`. A backend plugin's `load()` returns a class
built once per engine as `cls(StructuredOutputContext)`; the engine core's manager (pagedllm.structured_output)
calls it on a thread pool to compile a request's `StructuredOutputsParams`, caches what `compile` returns by the
constraint's key, and makes one `StructuredOutputGrammar` per request (per sample when n > 1) from it. Each
step the manager has every scheduled grammar fill its row of one batch bitmask ([rows, ceil(vocab / 32)]
int32, bit j of word w set = token 32 w + j allowed: xgrammar's and llguidance's shared layout); the runner
applies it to the logits on the device right before sampling; the sampled tokens then advance the grammars.

`validate` runs in the frontend process, before a request is queued, without a tokenizer: it must be cheap
and raise ValueError (with the offending field named, e.g. "structured_outputs.json: ...") for anything
`compile` would refuse, so bad input becomes a 400 and not a failed request later.

Light (typing only): the resolve-time protocol check imports this module; torch stays out of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StructuredOutputContext:
    """What a backend's constructor receives: the engine's tokenizer and vocabulary facts."""

    tokenizer: Any  # the model's Hugging Face tokenizer
    vocab_size: int  # the model's logits width (may exceed the tokenizer's: extra ids are never allowed)
    eos_token_ids: tuple[int, ...]  # the ids that end a sequence (a finished grammar allows only these)
    num_speculative_tokens: int = 0  # drafts per step: how far a grammar must be able to roll back
    plugin_config: Any = field(default_factory=dict)  # the config's `plugins.<backend name>` section


class StructuredOutputGrammar(Protocol):
    """One request's matcher state: advanced by accepted tokens, asked for the next token's mask."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over `tokens` (in order); False if one is not allowed (the state is then unspecified).

        Tokens after the grammar terminated are ignored (True)."""
        ...

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar would accept from here, without advancing it (drafts)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts the target rejected)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of the int32 CPU `bitmask`."""
        ...

    def is_terminated(self) -> bool:
        """The grammar reached its end (its stop token was accepted): the request finishes with `stop`."""
        ...


class StructuredOutputBackend(Protocol):
    """A structured-output backend (xgrammar, llguidance, ...): `cls(StructuredOutputContext)`."""

    @staticmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the field if this backend would refuse `params` (no tokenizer needed)."""
        ...

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile `params` for this engine's tokenizer (slow: runs on the manager's thread pool).

        The result is immutable and shared: the manager caches it by the constraint's key and makes every
        request's grammar from it with `make_grammar`. Raise ValueError for a constraint that cannot compile."""
        ...

    def make_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher at the start of `compiled` (cheap: one per request)."""
        ...
