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
    `logprobs=N` returns the sampled token's logprob plus the top N; `prompt_logprobs=N` returns, for every prompt
    position after the first, the logprob of the actual prompt token plus the top N (vLLM's semantics).
    `logit_bias` (token id -> bias added to its logit), `allowed_token_ids` (only these may be sampled) and
    `bad_words` (strings whose token sequences must not be generated) act before the penalties, as vLLM V1's.
    `truncate_prompt_tokens=K` keeps the last K prompt tokens.
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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Per-request arguments for logits processors and other plugins, keyed by plugin (vLLM's extra_args).
    extra_args: dict[str, Any] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, EBNF/Lark, structural tag); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the model's generation config; not a user knob.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: the ids min_tokens forbids -- stop_token_ids and every EOS id, with ignore_eos too
    # (vLLM's `all_stop_token_ids`: ignore_eos means EOS does not stop, not that it may end the minimum early).
    _min_tokens_stop_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine from `bad_words` and the tokenizer: each word's token sequence(s) (vLLM's).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

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
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", f"must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if self.stop_token_ids and not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty (nothing could be sampled)")
            if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", f"must be token ids (integers >= 0), got {self.allowed_token_ids!r}")
        if self.logit_bias:
            for tid, value in self.logit_bias.items():
                if not _is_int(tid) or tid < 0:
                    raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {tid!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                    raise bad("logit_bias", f"values must be numbers, got {value!r} for token {tid}")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be a list of non-blank strings")
        assert self.stop is not None
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def min_tokens_stop_ids(self) -> set[int]:
        """The ids forbidden until min_tokens is reached (stop ids and EOS, ignore_eos or not)."""
        return self._min_tokens_stop_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    def clone(self) -> SamplingParams:
        import copy

        # Shallow copy plus fresh containers: a deepcopy costs ~0.1 ms, paid once per request on admission.
        new = copy.copy(self)
        new.stop = list(self.stop or [])
        new.stop_token_ids = list(self.stop_token_ids or [])
        new._all_stop_token_ids = set(self._all_stop_token_ids)
        new._min_tokens_stop_ids = set(self._min_tokens_stop_ids)
        new._bad_words_token_ids = [list(ids) for ids in self._bad_words_token_ids]
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            new.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            new.bad_words = list(self.bad_words)
        if self.extra_args:
            new.extra_args = copy.deepcopy(self.extra_args)
        return new


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `True` as a token id is a client bug, not token 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class BeamSearchParams:
    """Beam search over the engine (`LLM.beam_search`; vLLM's `BeamSearchParams`, same field names).

    Each step every live beam runs as a one-token request asking for its top candidates' logprobs; the best
    `beam_width` continuations by cumulative logprob live on, and a beam ending in EOS (unless `ignore_eos`) or
    at `max_tokens` is scored `cum_logprob / generated_len ** length_penalty` (docs/sampling.md, "Beam search",
    says how this follows transformers and where it differs from vLLM). `temperature` > 0 samples each beam's
    one token, which joins its candidates (vLLM's behaviour); 0 keeps the search deterministic.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0.0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature}")
        if self.length_penalty != self.length_penalty:  # NaN would make every score NaN: no order at all
            raise ValueError("BeamSearchParams.length_penalty must be a number, got NaN")
