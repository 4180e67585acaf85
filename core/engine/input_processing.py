"""Frontend request preparation shared by LLMEngine (offline) and AsyncLLM (server): one place decides how a
prompt becomes token ids, how params are completed, which ids end a sequence, and how n > 1 fans out.

    RequestBuilder(tokenizer, ModelLimits.from_model(info, max_model_len), reject_unrunnable=...)
        .build(request_id, prompt, params) ──▶ PreparedRequest: the OutputProcessor's samples and one
                                               engine-core `Request` per sample

NOTE(1) end-of-sequence ids, as vLLM: the *primary* EOS (`Request.eos_token_id`) is the tokenizer's
`eos_token_id` (vLLM's InputPreprocessor.get_eos_token_id), and every id the model's generation config lists
(LoadedModelInfo.eos_token_ids: generation_config.json / config.json, or the GGUF's eos/eot/eom) joins it in
the ids that stop a sequence unless `ignore_eos` (vLLM's update_from_generation_config). Without a tokenizer
the primary EOS is the first id the model lists. The frontends used to pick the primary EOS out of the set
each their own way (an arbitrary set element offline, the smallest id in the server).

NOTE(2) the one difference between the frontends is a policy, named here: the server rejects a request the
core could never run (empty, out-of-vocabulary ids, too long for the context) at once, with the offending
parameter (an OpenAI 400); the offline engine accepts it and the core finishes it alone, with finish_reason
"error" and a message, so one bad prompt in a batch does not lose the others' results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.encoder_decoder_prompt import EncoderDecoderLimits, split_prompt
from pagedllm.protocols.loader import LoadedModelInfo
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

PromptType = str | list[int] | dict[str, Any]


class RequestValidationError(ValueError):
    """A request the engine will not run; `param` names the offending parameter (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked and completed against: the served model's context, vocabulary and EOS ids."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None  # the primary EOS (NOTE 1)
    eos_token_ids: frozenset[int]  # every id that ends a sequence unless ignore_eos (NOTE 1)
    # An encoder-decoder model's prompt rules (encoder_decoder_prompt.py); None for a decoder-only model.
    encoder_decoder: EncoderDecoderLimits | None = None

    @classmethod
    def from_model(cls, info: LoadedModelInfo, max_model_len: int) -> ModelLimits:
        primary, ids = eos_token_ids(info)
        return cls(max_model_len, int(info.hf_config.vocab_size), primary, frozenset(ids),
                   EncoderDecoderLimits.from_hf_config(info.hf_config))


def eos_token_ids(info: LoadedModelInfo) -> tuple[int | None, list[int]]:
    """(the primary EOS, every EOS id sorted): the tokenizer's eos and the model's listed ids (NOTE 1)."""
    tokenizer_eos = getattr(info.tokenizer, "eos_token_id", None)
    listed = [int(t) for t in info.eos_token_ids]
    primary = int(tokenizer_eos) if tokenizer_eos is not None else (listed[0] if listed else None)
    ids = set(listed)
    if primary is not None:
        ids.add(primary)
    return primary, sorted(ids)


@dataclass(frozen=True)
class PreparedRequest:
    """One frontend request, ready to queue: what the OutputProcessor tracks and what the core runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    samples: list[tuple[str, SamplingParams]]  # (engine-core id, completed params) per sample
    core_requests: list[Request]  # one per sample, in the same order


class RequestBuilder:
    """The frontends' one request-building sequence: id check, tokenize, validate (server policy, NOTE 2),
    complete the params (max_tokens, stop ids), fan out n samples, build the engine-core requests."""

    def __init__(
        self,
        tokenizer: Any | None,
        limits: ModelLimits,
        *,
        reject_unrunnable: bool,
        check_structured_outputs: Callable[[StructuredOutputsParams], StructuredOutputsParams] | None = None,
    ) -> None:
        """:param check_structured_outputs: returns the constraint the engine will run (engine-wide options
            applied), or raises ValueError naming the field for a constraint no backend can serve (pagedllm.structured_output.selection.validate_structured_outputs, bound to the engine's
            plugins); both frontends pass it, so a bad schema fails when the request is built (vLLM's
            validate_structured_output_request)."""
        self.tokenizer = tokenizer
        self.limits = limits
        self.reject_unrunnable = reject_unrunnable
        self.check_structured_outputs = check_structured_outputs

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def split_prompt(self, prompt: PromptType) -> tuple[PromptType, list[int] | None]:
        """(the decoder prompt, the encoder prompt's ids): an encoder-decoder model's two halves
        (encoder_decoder_prompt.py); (prompt, None) for a decoder-only model."""
        return split_prompt(prompt, self.limits.encoder_decoder, self.tokenize, self.limits.vocab_size)

    def build(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        *,
        in_use: Container[str] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        prompt_param: str = "prompt",
    ) -> PreparedRequest:
        """Raises RequestValidationError (a ValueError) for an id in `in_use` or a malformed prompt, and, with
        `reject_unrunnable`, for a request the core could never run."""
        if request_id in in_use:
            raise RequestValidationError(f"request id {request_id!r} is already in use", "request_id")
        prompt, encoder_ids = self.split_prompt(prompt)
        prompt_text, prompt_ids = self.tokenize(prompt)
        params = params or SamplingParams()
        prompt_ids = self.truncate(prompt_ids, params)
        self.validate_params(params)
        if self.reject_unrunnable:
            self.validate(prompt_ids, params, prompt_param)
        limits = self.limits
        params = complete_params(params, len(prompt_ids), limits.max_model_len, set(limits.eos_token_ids))
        if params.structured_outputs is not None:  # (on the private copy: the caller's params stay as given)
            params.structured_outputs = self.validate_structured_outputs(params.structured_outputs)
        if params.bad_words:
            params._bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples = fan_out(request_id, params)
        requests = [
            Request(core_id, prompt_ids, child, arrival_time=arrival, priority=priority,
                    eos_token_id=limits.eos_token_id, encoder_prompt_token_ids=encoder_ids)
            for core_id, child in samples
        ]
        return PreparedRequest(request_id, prompt_text, prompt_ids, arrival, samples, requests)

    def truncate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The last `truncate_prompt_tokens` prompt ids (vLLM keeps the end, where the question usually is)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if self.limits.encoder_decoder is not None:  # the decoder's start token must stay first
            raise RequestValidationError(
                "truncate_prompt_tokens is not supported for encoder-decoder models yet", "truncate_prompt_tokens"
            )
        if keep > self.limits.max_model_len:
            raise RequestValidationError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({self.limits.max_model_len}); "
                "select a smaller truncation size", "truncate_prompt_tokens",
            )
        return prompt_ids[-keep:]

    def validate_params(self, params: SamplingParams) -> None:
        """Token ids in the params must name tokens of this vocabulary, in either frontend (vLLM checks
        allowed_token_ids and logit_bias the same way); bad_words need a tokenizer to become ids."""
        vocab = self.limits.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids or ()),
                          ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestValidationError(
                    f"{name} must be token ids in [0, {vocab}) (this model's vocabulary), got {bad[:5]}", name
                )
        if params.bad_words and self.tokenizer is None:
            raise RequestValidationError("bad_words needs a tokenizer, and this model has none", "bad_words")

    def validate_structured_outputs(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """The constraint the engine runs; RequestValidationError with `param` = the field the backend's
        message starts with ("structured_outputs.json: ..."), for a constraint no backend serves."""
        if self.check_structured_outputs is None:
            return params
        try:
            return self.check_structured_outputs(params)
        except RequestValidationError:
            raise
        except ValueError as exc:
            message = str(exc)
            head = message.split(":", 1)[0]
            param = head if head.startswith("structured_outputs") and " " not in head else "structured_outputs"
            raise RequestValidationError(message, param) from None

    def validate_prompt(self, prompt_ids: list[int], prompt_param: str = "prompt") -> None:
        """Reject a prompt the core could never run: empty, ids outside the vocabulary, or no room left in
        the context for even one token. Both frontends raise for these (vLLM's LLM.generate raises too)."""
        max_len = self.limits.max_model_len
        if not prompt_ids:
            raise RequestValidationError("the prompt is empty", prompt_param)
        vocab = self.limits.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestValidationError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", prompt_param)
        if len(prompt_ids) >= max_len:
            raise RequestValidationError(
                f"This model's maximum context length is {max_len} tokens. However, the prompt has "
                f"{len(prompt_ids)} tokens, leaving no room for the completion.", prompt_param,
            )

    def validate(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Reject what the core could never run (NOTE 2), naming the parameter to fix."""
        self.validate_prompt(prompt_ids, prompt_param)
        max_len = self.limits.max_model_len
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_len:
            raise RequestValidationError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.", "max_tokens",
            )


def tokenize_prompt(tokenizer: Any | None, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids) for a string, a list of ids or a {"prompt" | "prompt_token_ids"} dict."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise RequestValidationError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestValidationError("this model has no tokenizer: pass prompt token ids instead of text", "prompt")
        try:
            return prompt, list(tokenizer(prompt).input_ids)
        except Exception as exc:  # e.g. lone surrogates a JSON body can carry but no tokenizer takes
            raise RequestValidationError(f"the prompt could not be tokenized: {exc}", "prompt") from exc
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise RequestValidationError(
        f"unsupported prompt type {type(prompt).__name__}: use str, list[int] or a dict", "prompt"
    )


def complete_params(
    params: SamplingParams | None, num_prompt_tokens: int, max_model_len: int, eos_token_ids: set[int]
) -> SamplingParams:
    """A private copy with max_tokens defaulted to the rest of the context and the stop-id set filled in."""
    params = (params or SamplingParams()).clone()
    if params.max_tokens is None:
        params.max_tokens = max(1, max_model_len - num_prompt_tokens)
    stop_ids = set(params.stop_token_ids or [])
    # min_tokens holds back EOS even with ignore_eos (vLLM's all_stop_token_ids always has it).
    params._min_tokens_stop_ids = stop_ids | eos_token_ids
    if not params.ignore_eos:
        stop_ids |= eos_token_ids
    params._all_stop_token_ids = stop_ids
    return params


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token sequence, alone and after a space (vLLM's update_from_tokenizer): a word
    mid-sentence is usually a different token (" word") than at the start ("word"). The spaced form is kept
    only when it is a different sequence of the same length (otherwise it is the same word tokenized the
    same way, or a space token followed by the word, which would ban every space)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        plain: list[int] | None = None
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                continue
            if plain is None:
                plain = ids
                sequences.append(ids)
            elif ids[0] != plain[0] and len(ids) == len(plain):
                sequences.append(ids)
    return sequences


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(engine-core id, params) per sample: n > 1 becomes n sequences sharing the prompt's cached blocks,
    each with its own (reproducible, when seeded) random stream."""
    if params.n == 1:
        return [(request_id, params)]
    samples = []
    for i in range(params.n):
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + i
        samples.append((f"{request_id}#{i}", child))
    return samples
