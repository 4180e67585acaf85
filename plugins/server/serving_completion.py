"""POST /v1/completions: one engine request per prompt, n choices each (choice index = prompt * n + sample)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.api.engine import AsyncLLM, Logprob, RequestOutput
from pagedllm.plugins.server.errors import APIError
from pagedllm.plugins.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    prompt_logprobs_out,
)
from pagedllm.plugins.server.serving_beam_search import check_beam_request, create_beam_completion
from pagedllm.plugins.server.serving_common import (
    check_model,
    merge,
    prepend,
    sampling_params,
    sse,
    sse_error,
    start_streams,
    trace_headers,
    until_disconnected,
    usage_of,
)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


class _LogprobsBuilder:
    """Accumulates OpenAI's legacy completion logprobs (parallel lists) for one choice."""

    def __init__(self, start_offset: int) -> None:
        self.lp = CompletionLogprobs()
        self.offset = start_offset

    def add(self, positions: list[dict[int, Logprob]]) -> CompletionLogprobs:
        delta = CompletionLogprobs()
        for pos in positions:
            items = list(pos.items())
            tid, sampled = items[0]
            token = sampled.decoded_token if sampled.decoded_token is not None else f"token_id:{tid}"
            delta.tokens.append(token)
            delta.token_logprobs.append(sampled.logprob)
            delta.top_logprobs.append({(lp.decoded_token or f"token_id:{t}"): lp.logprob for t, lp in items})
            delta.text_offset.append(self.offset)
            self.offset += len(token)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.lp, name).extend(getattr(delta, name))
        return delta


async def create_completion(engine: AsyncLLM, body: CompletionRequest, raw: Request) -> Any:
    check_model(engine, body.model)
    prompts = _prompts(body.prompt)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported", "echo")
    check_beam_request(body)
    if body.use_beam_search:
        beam_rid = f"cmpl-{uuid.uuid4().hex}"
        return await until_disconnected(raw, lambda: create_beam_completion(engine, body, prompts, beam_rid))
    params = sampling_params(body, body.max_tokens, body.logprobs, engine)
    rid = f"cmpl-{uuid.uuid4().hex}"
    context = trace_headers(raw)
    gens = [engine.generate(p, params, f"{rid}-{i}", trace_headers=context) for i, p in enumerate(prompts)]
    firsts = await start_streams(gens)
    streams = [prepend(first, gen) for first, gen in zip(firsts, gens)]
    echoes = [_echo_text(engine, p, f) if body.echo else "" for p, f in zip(prompts, firsts)]
    prompt_lens = [len(f.prompt_token_ids) for f in firsts]
    model = engine.model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(streams, rid, model, body.n, echoes, prompt_lens, include_usage, body.logprobs is not None),
            media_type="text/event-stream",
        )
    return await until_disconnected(raw, lambda: _collect(streams, rid, model, body.n, echoes, prompt_lens))


def _echo_text(engine: AsyncLLM, prompt: str | list[int], first: RequestOutput) -> str:
    if isinstance(prompt, str):
        return prompt
    tok = engine.tokenizer
    return "" if tok is None else str(tok.decode(first.prompt_token_ids))


async def _collect(
    streams: list[AsyncIterator[RequestOutput]], rid: str, model: str, n: int, echoes: list[str],
    prompt_lens: list[int],
) -> CompletionResponse:
    choices: dict[int, CompletionChoice] = {}
    builders: dict[int, _LogprobsBuilder] = {}
    completion_tokens = 0
    cached: dict[int, int] = {}  # per prompt: tokens it did not compute (prefix cache, KV connector)
    async for i, out in merge(streams):
        if out.error:
            raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
        cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
        for c in out.outputs:
            idx = i * n + c.index
            choice = choices.setdefault(idx, CompletionChoice(index=idx, text=echoes[i]))
            if choice.prompt_logprobs is None and out.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_out(out.prompt_logprobs)
            choice.text += c.text
            completion_tokens += len(c.token_ids)
            if c.logprobs is not None:
                builder = builders.setdefault(idx, _LogprobsBuilder(len(echoes[i])))
                builder.add(c.logprobs)
                choice.logprobs = builder.lp
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    ordered = [choices[k] for k in sorted(choices)]
    usage = usage_of(prompt_lens, completion_tokens, sum(cached.values()))
    return CompletionResponse(id=rid, model=model, choices=ordered, usage=usage)


async def _stream(
    streams: list[AsyncIterator[RequestOutput]], rid: str, model: str, n: int, echoes: list[str],
    prompt_lens: list[int], include_usage: bool, want_logprobs: bool,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    echoed: set[int] = set()
    builders: dict[int, _LogprobsBuilder] = {}
    completion_tokens = 0

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return sse(body, exact_floats=want_logprobs)

    cached: dict[int, int] = {}  # per prompt: tokens it did not compute (prefix cache, KV connector)
    try:
        async for i, out in merge(streams):
            if out.error:
                raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
            cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
            events: list[bytes] = []  # one write per engine output, however many choices it moved
            for c in out.outputs:
                idx = i * n + c.index
                text = c.text
                if idx not in echoed:
                    echoed.add(idx)
                    text = echoes[i] + text
                completion_tokens += len(c.token_ids)
                logprobs = None
                if want_logprobs and c.logprobs is not None:
                    builder = builders.setdefault(idx, _LogprobsBuilder(len(echoes[i])))
                    logprobs = builder.add(c.logprobs).model_dump()
                # Token ids without visible text (a held-back stop-string prefix, a model without a
                # tokenizer) still make a chunk: clients see progress and the stream's liveness.
                if not text and c.finish_reason is None and not logprobs and not c.token_ids:
                    continue
                events.append(chunk([{"index": idx, "text": text, "logprobs": logprobs,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]))
            if events:
                yield b"".join(events)
        if include_usage:
            yield chunk([], usage_of(prompt_lens, completion_tokens, sum(cached.values())).model_dump())
    except Exception as exc:
        yield sse_error(exc)
    yield sse("[DONE]")
