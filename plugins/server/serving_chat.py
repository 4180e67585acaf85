"""POST /v1/chat/completions: the model's chat template applied here, then one engine request with n samples.

Tool calling and reasoning (docs/tool_calling.md): tools.py reads `tools` / `tool_choice` into a plan (the
template's tools, the grammar for "required" or a named function); each choice's text then goes through a
ChoiceParser (chat_parsing.py: the reasoning parser, then the tool parser on the content), whole or delta
by delta.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.api.engine import AsyncLLM, Logprob, RequestOutput
from pagedllm.api.sched import SamplingParams, StructuredOutputsParams
from pagedllm.plugins.server.chat_parsing import ChatParsing, ChoiceParser, delta_tool_call_json
from pagedllm.plugins.server.errors import APIError
from pagedllm.plugins.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChoiceLogprobs,
    FunctionCallOut,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    prompt_logprobs_out,
)
from pagedllm.plugins.server.serving_common import (
    check_model,
    prepend,
    sampling_params,
    sse,
    sse_error,
    start_streams,
    trace_headers,
    until_disconnected,
    usage_of,
)
from pagedllm.plugins.server.structured_outputs import check_structured_outputs
from pagedllm.plugins.server.tools import ToolPlan, plan_tools, template_messages

NewParser = Callable[[], ChoiceParser | None]


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


@dataclasses.dataclass
class ChatRun:
    """One chat request started in the engine: its id, prompt, first output already in hand (so validation
    and queue errors have surfaced as status codes), and the parser factory for its choices' text."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: AsyncIterator[RequestOutput]
    new_parser: NewParser


async def start_chat(engine: AsyncLLM, body: ChatCompletionRequest, raw: Request,
                     messages: list[dict[str, Any]] | None = None, rid: str | None = None,
                     prompt_param: str = "messages") -> ChatRun:
    """Render, constrain and submit a chat request; shared by /v1/chat/completions and /v1/responses.

    `messages`: the template's messages when the caller built them itself (the Responses API's items),
    instead of `template_messages(body.messages)`; `prompt_param` names the field a prompt error blames."""
    check_model(engine, body.model)
    parsing: ChatParsing = getattr(raw.app.state, "chat_parsing", None) or ChatParsing()
    plan = plan_tools(body, parsing)
    if messages is None:
        messages = template_messages(body.messages)
    prompt_ids = engine.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                            tools=plan.tools or None,
                                            continue_final_message=body.continue_final_message,
                                            template_kwargs=body.chat_template_kwargs)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _constrained(engine, sampling_params(body, max_tokens, logprobs, engine), plan, parsing)
    new_parser = _parser_factory(engine, plan, parsing, params.structured_outputs is not None)
    rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
    gen = engine.generate({"prompt_token_ids": prompt_ids}, params, rid, prompt_param=prompt_param,
                          trace_headers=trace_headers(raw))
    (first,) = await start_streams([gen])
    return ChatRun(rid, prompt_ids, params, prepend(first, gen), new_parser)


async def create_chat_completion(engine: AsyncLLM, body: ChatCompletionRequest, raw: Request) -> Any:
    run = await start_chat(engine, body, raw)
    top_n = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(run.stream, run.rid, engine.model_name, body.n, len(run.prompt_ids), include_usage,
                    body.logprobs, top_n, run.new_parser),
            media_type="text/event-stream",
        )
    return await until_disconnected(
        raw, lambda: collect_chat(run.stream, run.rid, engine.model_name, len(run.prompt_ids), body.logprobs, top_n,
                                  run.new_parser)
    )


def _constrained(engine: AsyncLLM, params: SamplingParams, plan: ToolPlan, parsing: ChatParsing) -> SamplingParams:
    """The request's params with tool_choice's grammar ("required", a named function) and the special-token
    setting its parser needs."""
    changes: dict[str, Any] = {}
    if plan.schema is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {plan.mode} ({plan.function or 'any tool'}) holds the output to tool "
                           "calls; it cannot be combined with response_format or structured_outputs", "tool_choice")
        # NOTE: no free whitespace between tokens of the calls' JSON (vLLM's disable_any_whitespace): a grammar
        # allowing any amount lets a weak or unsure model spend max_tokens on blanks, seen with random weights
        # here; compact JSON is also what OpenAI's own tool calls carry.
        constraint = StructuredOutputsParams(json=plan.schema, disable_any_whitespace=True)
        check_structured_outputs(engine, constraint, "tools")
        changes["structured_outputs"] = constraint
    elif plan.mode == "auto" and getattr(parsing.tool_parser, "keep_special_tokens", False):
        changes["skip_special_tokens"] = False  # the parser's markers are special tokens
    return dataclasses.replace(params, **changes) if changes else params


def _parser_factory(engine: AsyncLLM, plan: ToolPlan, parsing: ChatParsing, constrained: bool) -> NewParser:
    """Builds one ChoiceParser per choice (parsers keep streaming state), or None when nothing is parsed.

    The reasoning parser sits out when a grammar (tool_choice's, response_format's) holds the output from its
    first token: there is no reasoning text then, and a parser for a template that opened `<think>` would
    take the whole answer for reasoning.
    """
    reasoning_cls = None if constrained else parsing.reasoning_parser
    if reasoning_cls is None and plan.mode == "none":
        return lambda: None
    tokenizer = engine.tokenizer
    strip = None
    if plan.mode == "auto" and getattr(parsing.tool_parser, "keep_special_tokens", False):
        strip = getattr(tokenizer, "eos_token", None)  # kept special tokens include the final EOS: not content

    def new() -> ChoiceParser:
        return ChoiceParser.build(reasoning_cls, tokenizer, plan.parser(parsing, tokenizer), plan.max_calls, strip)

    return new


def _message(parser: ChoiceParser | None, text: str) -> ChatMessageOut:
    if parser is None:
        return ChatMessageOut(content=text)
    parsed = parser.parse(text)
    calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    return ChatMessageOut(content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls or None)


def finish_reason_of(reason: str | None, called: bool) -> str | None:
    # OpenAI's: a turn that ends in tool calls finishes with "tool_calls" (a cut-off one stays "length").
    return "tool_calls" if called and reason == "stop" else reason


async def collect_chat(
    stream: AsyncIterator[RequestOutput], rid: str, model: str, prompt_len: int, want_logprobs: bool, top_n: int,
    new_parser: NewParser,
) -> ChatCompletionResponse:
    choices: dict[int, ChatChoice] = {}
    completion_tokens = 0
    cached = 0  # prompt tokens not computed for it (prefix cache, KV connector)
    prompt_logprobs = None
    async for out in stream:
        if out.error:
            raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
        cached = max(cached, out.num_cached_tokens)
        if prompt_logprobs is None and out.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_out(out.prompt_logprobs)
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
    for choice in choices.values():
        parser = new_parser()
        choice.message = _message(parser, choice.message.content or "")
        choice.finish_reason = finish_reason_of(choice.finish_reason, parser is not None and parser.called)
    ordered = [choices[k] for k in sorted(choices)]
    return ChatCompletionResponse(id=rid, model=model, choices=ordered,
                                  usage=usage_of([prompt_len], completion_tokens, cached), prompt_logprobs=prompt_logprobs)


def parsed_deltas(parser: ChoiceParser, text: str, finished: bool) -> list[dict[str, Any]]:
    """The `delta` objects one engine output becomes: reasoning, then content, then one per tool-call piece."""
    if not text and not finished:
        return []
    delta = parser.feed(text, finished)
    if delta is None:
        return []
    out: list[dict[str, Any]] = []
    if delta.reasoning_content:
        out.append({"reasoning_content": delta.reasoning_content})
    if delta.content:
        out.append({"content": delta.content})
    out.extend({"tool_calls": [delta_tool_call_json(d)]} for d in delta.tool_calls)
    return out


async def _stream(
    stream: AsyncIterator[RequestOutput], rid: str, model: str, n: int, prompt_len: int, include_usage: bool,
    want_logprobs: bool, top_n: int, new_parser: NewParser,
) -> AsyncIterator[bytes]:
    """OpenAI's chunk sequence: per choice a role chunk, content deltas, an empty delta with finish_reason;
    then (include_usage) a chunk with no choices and the usage; then `data: [DONE]`.

    With parsers, `reasoning_content` deltas and `tool_calls` deltas (one chunk per piece: a call's id and
    name, then its argument fragments) take the place of the content they were cut from.
    """
    created = int(time.time())
    completion_tokens = 0
    parsers: dict[int, ChoiceParser | None] = {}

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return sse(body, exact_floats=want_logprobs)

    def choice(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    try:
        for i in range(n):
            yield chunk([choice(i, {"role": "assistant", "content": ""})])
        async for out in stream:
            if out.error:
                raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
            events: list[bytes] = []  # one write per engine output: its content and finish chunks together
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if want_logprobs and c.logprobs:
                    logprobs = ChoiceLogprobs(content=_logprobs(c.logprobs, top_n)).model_dump()
                if c.index not in parsers:
                    parsers[c.index] = new_parser()
                parser = parsers[c.index]
                if parser is None:
                    if c.text or logprobs:
                        events.append(chunk([choice(c.index, {"content": c.text}, None, logprobs)]))
                    if c.finish_reason is not None:
                        events.append(chunk([choice(c.index, {}, c.finish_reason)]))
                    continue
                finished = c.finish_reason is not None
                for delta in parsed_deltas(parser, c.text, finished):
                    events.append(chunk([choice(c.index, delta, None, logprobs)]))
                    logprobs = None
                if logprobs:  # the tokens' text is held back by a parser for now; their logprobs are not
                    events.append(chunk([choice(c.index, {"content": ""}, None, logprobs)]))
                if finished:
                    events.append(chunk([choice(c.index, {}, finish_reason_of(c.finish_reason, parser.called))]))
            if events:
                yield b"".join(events)
        if include_usage:
            yield chunk([], usage_of([prompt_len], completion_tokens).model_dump())
    except Exception as exc:
        yield sse_error(exc)
    yield sse("[DONE]")
