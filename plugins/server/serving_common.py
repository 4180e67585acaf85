"""What completions and chat share: request → SamplingParams, SSE framing, merging streams, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request

from pagedllm.api.engine import AsyncLLM, RequestOutput
from pagedllm.api.sched import SamplingParams
from pagedllm.plugins.server.errors import APIError, error_body, from_exception
from pagedllm.plugins.server.protocol import PromptTokensDetails, Usage
from pagedllm.plugins.server.structured_outputs import check_structured_outputs, structured_outputs_of

T = TypeVar("T")

DISCONNECT_POLL_S = 0.5


def check_model(engine: AsyncLLM, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise APIError(400, f"The model '{model}' does not exist; this server serves '{engine.model_name}'.",
                       "model", "model_not_found")


# W3C trace context: a request carrying it gets its trace (pagedllm.tracing) under the caller's span.
TRACE_HEADERS = ("traceparent", "tracestate")


def trace_headers(raw: Request) -> dict[str, str] | None:
    """The request's W3C trace-context headers, or None when it has none."""
    found = {h: raw.headers[h] for h in TRACE_HEADERS if h in raw.headers}
    return found or None


def sampling_params(body: Any, max_tokens: int | None, logprobs: int | None,
                    engine: AsyncLLM | None = None) -> SamplingParams:
    """SamplingParams from a request body; unset OpenAI fields keep the engine's defaults. With `engine`, a
    structured-output constraint is validated here, so its 400 names the field the client sent."""
    structured, structured_param = structured_outputs_of(body)
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
        # OpenAI's logit_bias keys are token ids written as strings (the schema admits digits only).
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
        prompt_logprobs=body.prompt_logprobs,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        # vLLM's vllm_xargs reach logits-processor plugins as SamplingParams.extra_args.
        extra_args=dict(body.vllm_xargs) if body.vllm_xargs else None,
        structured_outputs=structured,
    )
    transfer = getattr(body, "kv_transfer_params", None)
    if transfer is not None:
        if engine is not None and engine.config.kv_transfer.kv_connector is None:
            raise APIError(400, "kv_transfer_params: this server runs no KV connector "
                           "(kv_transfer.kv_connector, e.g. pd)", "kv_transfer_params")
        # The connector reads them from the request (plugins/kv_connectors/pd), as vLLM's connectors do.
        kw["extra_args"] = {**(kw["extra_args"] or {}), "kv_transfer_params": transfer.model_dump()}
    if structured is not None and engine is not None:
        assert structured_param is not None
        check_structured_outputs(engine, structured, structured_param)
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


def sse(data: dict[str, Any] | str, exact_floats: bool = False) -> bytes:
    """One server-sent event, as the bytes written. msgspec encodes a chunk several times faster than `json`
    (each stream writes one per engine step), but writes a non-finite float as null where `json` writes
    -Infinity, which Python clients (the openai one among them) read back as -inf: a chunk that carries
    logprobs (-inf for a token the sampler excluded) passes `exact_floats`."""
    if isinstance(data, str):
        return b"data: " + data.encode() + b"\n\n"
    if exact_floats:
        return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    """A mid-stream failure: headers are already sent, so the error travels as an event (as vLLM does)."""
    err = from_exception(exc)
    return sse(error_body(err.status, err.message, err.param, err.code))


def usage_of(prompt_lens: list[int], completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    prompt = sum(prompt_lens)
    details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens,
                 prompt_tokens_details=details)


async def start_streams(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The first output of each generator: validation, queue-full and engine errors surface here, before any
    response byte is sent (so they become proper status codes).

    Every generator starts at once (each prompt x n of a request is its own engine request, and they share
    the core's batches); awaiting them one after another made a 32-prompt request wait for 32 first tokens
    in turn. On any failure, or cancellation (a disconnect), every generator is closed, which aborts its
    request in the core."""
    tasks = [asyncio.create_task(_first(gen)) for gen in gens]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()  # type: ignore[attr-defined]
        raise


async def _first(gen: AsyncIterator[T]) -> T:
    return await gen.__anext__()


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
    requests and frees their KV blocks); non-streaming responses get no other disconnect signal.

    The work is cancelled too when this coroutine is (an outer watcher saw the disconnect first): left
    running, it would keep its engine requests to the end and fail later with nobody to hear it."""
    task = asyncio.create_task(work())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(400, "the client disconnected", None, "client_disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
