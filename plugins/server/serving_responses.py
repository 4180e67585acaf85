"""POST /v1/responses: the OpenAI Responses API, served by the chat machinery.

A Responses request is read into a chat request (instructions -> a system turn, input items -> turns:
function_call items -> the assistant's tool_calls, function_call_output items -> tool turns, reasoning items ->
the assistant turn's reasoning_content; tools, tool_choice and text.format -> chat's tools, tool_choice and
response_format), then run by serving_chat.start_chat: the same template, tool plan, grammar and parsers as
/v1/chat/completions. The parsed choice becomes output items -- a `reasoning` item, a `message` with one
`output_text` part, one `function_call` item per call -- whole, or streamed as OpenAI's event sequence:

    response.created, response.in_progress
    per item:  output_item.added
               reasoning: content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
               message:   content_part.added, output_text.delta..., output_text.done, content_part.done
               call:      function_call_arguments.delta..., function_call_arguments.done
               output_item.done
    response.completed (response.incomplete when max_output_tokens cut it off)

There is no response store: `store` must be false or absent and `previous_response_id` is a 400, so the
client resends the conversation as `input` (the tool loop: append `response.output` and a
function_call_output item).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.api.engine import AsyncLLM, RequestOutput
from pagedllm.plugins.server.errors import APIError, error_body, from_exception
from pagedllm.plugins.server.protocol import ChatCompletionRequest
from pagedllm.plugins.server.responses_protocol import (
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from pagedllm.plugins.server.serving_chat import (
    ChatRun,
    collect_chat,
    finish_reason_of,
    parsed_deltas,
    start_chat,
)
from pagedllm.plugins.server.serving_common import until_disconnected
from pagedllm.plugins.server.tools import template_messages

# Chat's parameter names in the errors start_chat raises -> the Responses field the client sent.
_PARAMS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("messages", "input"))


def _renamed(err: APIError) -> APIError:
    param, message = err.param, err.message
    for chat, responses in _PARAMS:
        message = message.replace(chat, responses)
        if param is not None and (param == chat or param.startswith(chat + ".")):
            param = responses + param[len(chat):]
    return APIError(err.status, message, param, err.code)


def _refuse_stored_state(body: ResponsesRequest) -> None:
    if body.store:
        raise APIError(400, "store: this server keeps no responses; send store=false (or leave it out) and resend "
                       "the conversation as input", "store", "unsupported_value")
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id: this server keeps no responses; send the earlier turns (and "
                       "their output items) as input instead", "previous_response_id", "unsupported_value")


def chat_request_of(body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request that serves `body`, and the template's messages (with reasoning_content attached)."""
    messages: list[dict[str, Any]] = []
    reasoning: dict[int, str] = {}  # chat message index -> the reasoning the assistant turn carried
    pending_reasoning: list[str] = []
    call_ids: set[str] = set()
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input

    def assistant_turn() -> dict[str, Any]:
        # Calls right after the assistant's text (or other calls) belong to the same turn.
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if pending_reasoning:
            reasoning[len(messages) - 1] = "".join(pending_reasoning)
            pending_reasoning.clear()
        return last

    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            pending_reasoning.append(item.text())
        elif isinstance(item, MessageItem):
            if item.role == "assistant":
                turn = assistant_turn()
                turn["content"] += item.text()
            else:
                messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except ValueError:
                raise APIError(400, f"input[{i}].arguments: the arguments of {item.name!r} are not JSON",
                               "input") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            assistant_turn().setdefault("tool_calls", []).append(call)
            call_ids.add(item.call_id)
        else:
            assert isinstance(item, FunctionCallOutputItem)
            if item.call_id not in call_ids:
                raise APIError(400, f"input[{i}].call_id: no function_call item before it has call_id "
                               f"{item.call_id!r}", "input")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    if pending_reasoning:  # reasoning with nothing after it: an assistant turn of its own
        assistant_turn()
    chat = ChatCompletionRequest.model_validate({
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools] if body.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": body.tool_choice.name}}
                        if body.tool_choice is not None and not isinstance(body.tool_choice, str)
                        else body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
    })
    rendered = template_messages(chat.messages)
    for index, text in reasoning.items():
        rendered[index]["reasoning_content"] = text
    return chat, rendered


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    if isinstance(fmt, FormatJsonSchema):
        return {"type": "json_schema", "json_schema": fmt.model_dump(exclude={"type"}, by_alias=True,
                                                                     exclude_none=True)}
    return {"type": fmt.type}


@dataclass
class _Counts:
    """What the usage needs from the engine outputs as they pass by."""

    cached_tokens: int = 0


async def _watched(stream: AsyncIterator[RequestOutput], counts: _Counts) -> AsyncIterator[RequestOutput]:
    async for out in stream:
        counts.cached_tokens = out.num_cached_tokens
        yield out


async def create_response(engine: AsyncLLM, body: ResponsesRequest, raw: Request) -> Any:
    _refuse_stored_state(body)
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        chat, messages = chat_request_of(body)
        run = await start_chat(engine, chat, raw, messages=messages, rid=rid, prompt_param="input")
    except Exception as exc:
        raise _renamed(from_exception(exc)) from exc
    counts = _Counts()
    stream = _watched(run.stream, counts)
    shape = _Shape(engine, body, run, time.time())
    if body.stream:
        return StreamingResponse(_events(stream, run, shape, counts), media_type="text/event-stream")

    async def whole() -> dict[str, Any]:
        chat_response = await collect_chat(stream, rid, engine.model_name, len(run.prompt_ids), False, 0,
                                           run.new_parser)
        choice = chat_response.choices[0]
        message = choice.message
        items: list[dict[str, Any]] = []
        incomplete = choice.finish_reason == "length"
        if message.reasoning_content:
            items.append(_reasoning_item(_new_id("rs"), message.reasoning_content))
        if message.content:
            items.append(_message_item(_new_id("msg"), message.content, incomplete))
        for call in message.tool_calls or []:
            items.append(_call_item(_new_id("fc"), call.id, call.function.name, call.function.arguments))
        if not items:
            items.append(_message_item(_new_id("msg"), "", incomplete))
        completion_tokens = chat_response.usage.completion_tokens if chat_response.usage else 0
        return shape.response(items, incomplete, counts.cached_tokens, completion_tokens, message.reasoning_content)

    return await until_disconnected(raw, whole)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, incomplete: bool = False,
                  status: str | None = None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "content": content,
            "status": status or ("incomplete" if incomplete else "completed")}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


@dataclass
class _Shape:
    """The response object around the output items: the request's settings echoed, status, usage."""

    engine: AsyncLLM
    body: ResponsesRequest
    run: ChatRun
    created: float

    def response(self, output: list[dict[str, Any]], incomplete: bool, cached_tokens: int, output_tokens: int,
                 reasoning: str | None, status: str | None = None) -> dict[str, Any]:
        body, params = self.body, self.run.params
        done = status is None
        status = status or ("incomplete" if incomplete else "completed")
        choice = body.tool_choice
        tool_choice = (choice.model_dump() if choice is not None and not isinstance(choice, str)
                       else choice or "auto")
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        usage = None
        if done:
            input_tokens = len(self.run.prompt_ids)
            usage = {"input_tokens": input_tokens,
                     "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": output_tokens,
                     "output_tokens_details": {"reasoning_tokens": self._token_count(reasoning)},
                     "total_tokens": input_tokens + output_tokens}
        return {
            "id": self.run.rid, "object": "response", "created_at": self.created,
            "completed_at": time.time() if done else None, "status": status, "model": self.engine.model_name,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "temperature": params.temperature, "top_p": params.top_p,
            "tool_choice": tool_choice, "tools": [t.model_dump() for t in body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True) if fmt is not None else {"type": "text"}},
            "truncation": "disabled", "usage": usage, "user": body.user,
        }

    def _token_count(self, text: str | None) -> int:
        # The reasoning text re-encoded: the parser splits text, not tokens (a marker may share a token).
        if not text or self.engine.tokenizer is None:
            return 0
        return len(self.engine.tokenizer(text, add_special_tokens=False).input_ids)


@dataclass
class _OpenItem:
    kind: str  # "reasoning", "message" or "function_call"
    item_id: str
    output_index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass
class _EventWriter:
    """Chat-style deltas in, Responses events out: one item open at a time, closed when the kind changes."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: _OpenItem | None = None
    sequence: int = 0
    calls: dict[int, _OpenItem] = field(default_factory=dict)

    def event(self, type_: str, **fields: Any) -> str:
        body = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type_}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self, kind: str, **extra: Any) -> list[str]:
        out = self.close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = self.open = _OpenItem(kind, _new_id(prefix), len(self.items), **extra)
        self.items.append({})  # its place in the output; filled when it closes
        if kind == "function_call":
            added = _call_item(item.item_id, item.call_id, item.name, "", "in_progress")
        elif kind == "message":
            added = _message_item(item.item_id, None, status="in_progress")
        else:
            added = _reasoning_item(item.item_id, None, "in_progress")
        out.append(self.event("response.output_item.added", output_index=item.output_index, item=added))
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else (
            {"type": "output_text", "text": "", "annotations": []} if kind == "message" else None)
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item.item_id,
                                  output_index=item.output_index, content_index=0, part=part))
        return out

    def text(self, kind: str, delta: str) -> list[str]:
        out = self.start(kind) if self.open is None or self.open.kind != kind else []
        item = self.open
        assert item is not None
        item.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=item.item_id, output_index=item.output_index, content_index=0,
                              delta=delta, **extra))
        return out

    def call(self, piece: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = piece["index"]
        function = piece.get("function") or {}
        if index not in self.calls:  # a call's first piece carries its id and name
            out += self.start("function_call", call_id=piece["id"], name=function.get("name") or "")
            assert self.open is not None
            self.calls[index] = self.open
        item = self.calls[index]
        arguments = function.get("arguments")
        if arguments:
            item.text += arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item.item_id,
                                  output_index=item.output_index, delta=arguments))
        return out

    def close(self, incomplete: bool = False) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        out: list[str] = []
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "function_call":
            out.append(self.event("response.function_call_arguments.done", **where, arguments=item.text))
            done = _call_item(item.item_id, item.call_id, item.name, item.text)
        elif item.kind == "message":
            out.append(self.event("response.output_text.done", **where, content_index=0, text=item.text,
                                  logprobs=[]))
            done = _message_item(item.item_id, item.text, incomplete)
            out.append(self.event("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        else:
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=item.text))
            done = _reasoning_item(item.item_id, item.text)
            out.append(self.event("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        self.items[item.output_index] = done
        out.append(self.event("response.output_item.done", output_index=item.output_index, item=done))
        return out

    def reasoning_text(self) -> str | None:
        texts = [i["content"][0]["text"] for i in self.items if i.get("type") == "reasoning"]
        return "".join(texts) if texts else None


async def _events(stream: AsyncIterator[RequestOutput], run: ChatRun, shape: _Shape, counts: _Counts
                  ) -> AsyncIterator[str]:
    writer = _EventWriter()
    initial = shape.response([], False, 0, 0, None, status="in_progress")
    yield writer.event("response.created", response=initial)
    yield writer.event("response.in_progress", response=initial)
    parser = run.new_parser()
    output_tokens = 0
    finish: str | None = None
    try:
        async for out in stream:
            if out.error:
                raise APIError(500, f"the engine failed this request: {out.error}", None, "engine_error")
            for c in out.outputs:
                output_tokens += len(c.token_ids)
                finished = c.finish_reason is not None
                if finished:
                    finish = c.finish_reason
                deltas: list[dict[str, Any]] = ([{"content": c.text}] if c.text else []) if parser is None else (
                    parsed_deltas(parser, c.text, finished))
                for delta in deltas:
                    if delta.get("reasoning_content"):
                        for event in writer.text("reasoning", delta["reasoning_content"]):
                            yield event
                    if delta.get("content"):
                        for event in writer.text("message", delta["content"]):
                            yield event
                    for piece in delta.get("tool_calls") or []:
                        for event in writer.call(piece):
                            yield event
        incomplete = finish_reason_of(finish, bool(writer.calls)) == "length"
        for event in writer.close(incomplete):
            yield event
        if not writer.items:  # nothing at all was generated: an empty message, as the whole response has
            for event in writer.start("message") + writer.close(incomplete):
                yield event
        final = shape.response(writer.items, incomplete, counts.cached_tokens, output_tokens, writer.reasoning_text())
        yield writer.event("response.incomplete" if incomplete else "response.completed", response=final)
    except Exception as exc:
        # Headers are sent: the failure travels as OpenAI's `error` event, which ends the stream.
        api = _renamed(from_exception(exc))
        kind = error_body(api.status, api.message)["error"]["type"]
        yield writer.event("error", code=api.code or kind, message=api.message, param=api.param)
