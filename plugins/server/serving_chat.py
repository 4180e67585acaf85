"""POST /v1/chat/completions: the model's chat template applied here, then one engine request with n samples."""

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
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
)
from pagedllm.plugins.server.serving_common import (
    check_model,
    prepend,
    sampling_params,
    sse,
    sse_error,
    start_streams,
    until_disconnected,
    usage_of,
)


def _logprobs(positions: list[dict[int, Logprob]], top_n: int) -> list[TokenLogprob]:
    out = []
    for pos in positions:
        items = list(pos.items())
        tid, sampled = items[0]

        def name(t: int, lp: Logprob) -> str:
            return lp.decoded_token if lp.decoded_token is not None else f"token_id:{t}"

        ranked = sorted(items, key=lambda kv: -kv[1].logprob)[:top_n]
        token = name(tid, sampled)
        out.append(TokenLogprob(
            token=token, logprob=sampled.logprob, bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=name(t, lp), logprob=lp.logprob, bytes=list(name(t, lp).encode("utf-8")))
                          for t, lp in ranked],
        ))
    return out


async def create_chat_completion(engine: AsyncLLM, body: ChatCompletionRequest, raw: Request) -> Any:
    check_model(engine, body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = engine.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = engine.generate({"prompt_token_ids": prompt_ids}, params, rid, prompt_param="messages")
    (first,) = await start_streams([gen])
    stream = prepend(first, gen)
    top_n = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(stream, rid, engine.model_name, body.n, len(prompt_ids), include_usage, body.logprobs, top_n),
            media_type="text/event-stream",
        )
    return await until_disconnected(
        raw, lambda: _collect(stream, rid, engine.model_name, len(prompt_ids), body.logprobs, top_n)
    )


async def _collect(
    stream: AsyncIterator[RequestOutput], rid: str, model: str, prompt_len: int, want_logprobs: bool, top_n: int
) -> ChatCompletionResponse:
    choices: dict[int, ChatChoice] = {}
    completion_tokens = 0
    async for out in stream:
        if out.error:
            raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
        for c in out.outputs:
            choice = choices.setdefault(c.index, ChatChoice(index=c.index, message=ChatMessageOut(content="")))
            choice.message.content = (choice.message.content or "") + c.text
            completion_tokens += len(c.token_ids)
            if want_logprobs and c.logprobs is not None:
                choice.logprobs = choice.logprobs or ChoiceLogprobs(content=[])
                assert choice.logprobs.content is not None
                choice.logprobs.content.extend(_logprobs(c.logprobs, top_n))
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    ordered = [choices[k] for k in sorted(choices)]
    return ChatCompletionResponse(id=rid, model=model, choices=ordered, usage=usage_of([prompt_len], completion_tokens))


async def _stream(
    stream: AsyncIterator[RequestOutput], rid: str, model: str, n: int, prompt_len: int, include_usage: bool,
    want_logprobs: bool, top_n: int,
) -> AsyncIterator[str]:
    """OpenAI's chunk sequence: per choice a role chunk, content deltas, an empty delta with finish_reason;
    then (include_usage) a chunk with no choices and the usage; then `data: [DONE]`."""
    created = int(time.time())
    completion_tokens = 0

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    def choice(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    try:
        for i in range(n):
            yield chunk([choice(i, {"role": "assistant", "content": ""})])
        async for out in stream:
            if out.error:
                raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if want_logprobs and c.logprobs:
                    logprobs = ChoiceLogprobs(content=_logprobs(c.logprobs, top_n)).model_dump()
                if c.text or logprobs:
                    yield chunk([choice(c.index, {"content": c.text}, None, logprobs)])
                if c.finish_reason is not None:
                    yield chunk([choice(c.index, {}, c.finish_reason)])
        if include_usage:
            yield chunk([], usage_of([prompt_len], completion_tokens).model_dump())
    except Exception as exc:
        yield sse_error(exc)
    yield sse("[DONE]")
