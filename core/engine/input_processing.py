"""Frontend request preparation shared by LLMEngine (offline) and AsyncLLM (server): one place decides how a
prompt becomes token ids, how params are completed, and how n > 1 fans out."""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class RequestValidationError(ValueError):
    """A request the engine will not run; `param` names the offending parameter (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    if not params.ignore_eos:
        stop_ids |= eos_token_ids
    params._all_stop_token_ids = stop_ids
    return params


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
