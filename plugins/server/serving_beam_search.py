"""POST /v1/completions with `use_beam_search: true` (vLLM's extension): the best `n` beams of each prompt.

`n` is the beam width (vLLM's to_beam_search_params); the choices are the `n` beams, best first, choice
index = prompt * n + rank; `truncate_prompt_tokens` keeps the prompt's end, as for sampling. Beam search
returns whole sequences, so a stream is refused (as vLLM refuses it), and so is every sampling field it cannot
honour (protocol.BEAM_SEARCH_NEUTRAL) -- vLLM drops those silently.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.api.engine import (
    AsyncLLM,
    BeamSearchOutput,
    BeamSearchParams,
    SamplingParams,
    beam_search_async,
)
from pagedllm.plugins.server.errors import APIError, from_exception
from pagedllm.plugins.server.protocol import (
    BEAM_SEARCH_NEUTRAL,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)


def check_beam_request(body: CompletionRequest) -> None:
    """A 400 naming the field for what beam search cannot do with this body; before anything runs."""
    if not body.use_beam_search:
        if body.length_penalty is not None:
            raise APIError(400, "length_penalty is only used by beam search: send it with use_beam_search=true",
                           "length_penalty")
        return
    if body.stream:
        raise APIError(400, "stream=true is not supported with use_beam_search (beam search returns whole "
                            "sequences, as vLLM's)", "stream")
    for name, neutral in BEAM_SEARCH_NEUTRAL.items():
        if getattr(body, name) != neutral:
            raise APIError(400, f"{name} is not supported with use_beam_search", name)


async def create_beam_completion(
    engine: AsyncLLM, body: CompletionRequest, prompts: list[str | list[int]], rid: str
) -> CompletionResponse:
    """Every prompt's search runs concurrently (their steps batch together in the engine)."""
    try:
        prompt_ids = [_prompt_ids(engine, body, p) for p in prompts]
        searches = [
            beam_search_async(engine, {"prompt_token_ids": ids}, _params(engine, body, ids), f"{rid}-{i}")
            for i, ids in enumerate(prompt_ids)
        ]
        outputs: list[BeamSearchOutput] = await asyncio.gather(*searches)
    except Exception as exc:
        raise from_exception(exc) from None
    choices: list[CompletionChoice] = []
    prompt_tokens = completion_tokens = 0
    for i, out in enumerate(outputs):
        prompt_tokens += out.sequences[0].num_prompt_tokens
        for rank, seq in enumerate(out.sequences):
            completion_tokens += len(seq.generated)
            choices.append(CompletionChoice(
                index=i * body.n + rank, text=seq.text or "", finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  total_tokens=prompt_tokens + completion_tokens)
    return CompletionResponse(id=rid, model=engine.model_name, choices=choices, usage=usage)


def _prompt_ids(engine: AsyncLLM, body: CompletionRequest, prompt: str | list[int]) -> list[int]:
    """The prompt's ids, truncated to `truncate_prompt_tokens` as a sampled request's are (same checks)."""
    _, ids = engine.tokenize(prompt)
    return engine.requests.truncate(ids, SamplingParams(truncate_prompt_tokens=body.truncate_prompt_tokens))


def _params(engine: AsyncLLM, body: CompletionRequest, ids: list[int]) -> BeamSearchParams:
    """max_tokens as a sampled request gets it: above the server's ceiling a 400, absent the rest of the
    context (within the ceiling)."""
    ceiling = engine.limits.max_tokens
    max_tokens = body.max_tokens
    if max_tokens is not None and ceiling is not None and max_tokens > ceiling:
        raise APIError(400, f"max_tokens ({max_tokens}) exceeds this server's limit of {ceiling} tokens per "
                            "request", "max_tokens")
    if max_tokens is None:
        room = engine.max_model_len - len(ids)
        max_tokens = max(1, room if ceiling is None else min(ceiling, room))
    kw: dict[str, Any] = {}
    if body.temperature is not None:
        kw["temperature"] = body.temperature
    if body.length_penalty is not None:
        kw["length_penalty"] = body.length_penalty
    return BeamSearchParams(
        beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output, **kw,
    )
