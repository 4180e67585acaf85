"""SamplingParams: how one request samples and when it stops. Field names follow vLLM's so code can switch."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

_GREEDY_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """What each RequestOutput of an unfinished request carries (vLLM's names and values).

    CUMULATIVE: everything so far; DELTA: only what this step added; FINAL_ONLY: nothing until it finishes
    (then everything). `LLM.generate` asks for FINAL_ONLY: copying every running request's growing token list
    on every step costs O(length) host time per request per step, for outputs nobody reads.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `StructuredOutputsParams`, same field names).

    Exactly one of json / regex / choice / grammar / json_object / structural_tag is set. `json` is a JSON
    schema (a dict or its JSON text); `json_object` asks for any JSON object; `grammar` is EBNF (GBNF) or Lark
    text; `structural_tag` is the JSON text of an xgrammar-style structural tag. `backend` names a
    structured-output plugin (None: the selector picks one that supports the constraint).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {set_kinds or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1.0 and min_p 0.0 disable theirs.
    `logprobs=N` returns the sampled token's logprob plus the top N; `prompt_logprobs` is not supported yet.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Per-request arguments for logits processors and other plugins, keyed by plugin (vLLM's extra_args).
    extra_args: dict[str, Any] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, EBNF/Lark, structural tag); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the model's generation config; not a user knob.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                f"SamplingParams.output_kind must be one of {[k.name for k in RequestOutputKind]}, got {self.output_kind!r}"
            ) from None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be >= 0, got {self.logprobs}")
        assert self.stop is not None
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def clone(self) -> SamplingParams:
        import copy

        # Shallow copy plus fresh containers: a deepcopy costs ~0.1 ms, paid once per request on admission.
        new = copy.copy(self)
        new.stop = list(self.stop or [])
        new.stop_token_ids = list(self.stop_token_ids or [])
        new._all_stop_token_ids = set(self._all_stop_token_ids)
        if self.extra_args:
            new.extra_args = copy.deepcopy(self.extra_args)
        return new
