"""What completions and chat share: request → SamplingParams, SSE framing, merging streams, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request

from pagedllm.api.engine import AsyncLLM, RequestOutput
from pagedllm.api.sched import SamplingParams
from pagedllm.plugins.server.errors import APIError, error_body, from_exception
from pagedllm.plugins.server.protocol import Usage

T = TypeVar("T")

DISCONNECT_POLL_S = 0.5


def check_model(engine: AsyncLLM, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise APIError(400, f"The model '{model}' does not exist; this server serves '{engine.model_name}'.",
                       "model", "model_not_found")


def sampling_params(body: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """SamplingParams from a request body; unset OpenAI fields keep the engine's defaults."""
    kw: dict[str, Any] = dict(
        n=body.n,
        max_tokens=max_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kw[name] = value
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        raise from_exception(exc) from None


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    """A mid-stream failure: headers are already sent, so the error travels as an event (as vLLM does)."""
    err = from_exception(exc)
    return sse(error_body(err.status, err.message, err.param, err.code))


def usage_of(prompt_lens: list[int], completion_tokens: int) -> Usage:
    prompt = sum(prompt_lens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


async def start_streams(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The first output of each generator: validation, queue-full and engine errors surface here, before any
    response byte is sent (so they become proper status codes). Already-started generators are closed on
    failure, which aborts their requests."""
    firsts: list[RequestOutput] = []
    try:
        for gen in gens:
            firsts.append(await gen.__anext__())
    except BaseException:
        for gen in gens:
            await gen.aclose()  # type: ignore[attr-defined]
        raise
    return firsts


async def merge(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, tagged with the iterator's index.

    Closing the merged iterator (a disconnect) cancels every pump, which closes every generator.
    """
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def until_disconnected(request: Request, work: Callable[[], Any]) -> Any:
    """Run `work()` (a coroutine factory), cancelling it if the client goes away (which aborts its
    requests and frees their KV blocks); non-streaming responses get no other disconnect signal."""
    task = asyncio.create_task(work())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(400, "the client disconnected", None, "client_disconnected")
