"""/v1/responses (the OpenAI Responses API) through the live server, read by the official `openai` client.

The server of tests/test_server_tools.py (tests/tool_models.py): a tiny random model whose chat template
renders tools and opens `<think>`, `--enable-auto-tool-choice`, reasoning parser deepseek_r1, and the
`force_text` logits processor, which makes every unconstrained request write one fixed reasoning-then-hermes-call
text (tool_models.FORCED_TEXT). No `--tool-call-parser`: hermes is chosen from the template's `<tool_call>`, so
every auto tool call here also shows that choice at work. So:
- plain text and tool_choice "auto": what the client receives is checked against that text, which the tests
  wrote, not the server;
- tool_choice "required" and text.format json_schema: only the grammar stands between random weights and the
  output, so a result that validates with `jsonschema` shows the constraint at work;
- prompts: usage.input_tokens equals transformers' own rendering of the same conversation;
- streams: the events are accumulated by the client's own `responses.stream` helper (which checks item
  identities) and by hand, and compared with the non-streamed response of the same greedy request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("zmq")
jsonschema = pytest.importorskip("jsonschema")

import openai  # noqa: E402
from test_server_support import LiveServer  # noqa: E402
from tool_models import CALL, FORCED_TEXT, REASONING, make_tokenizer  # noqa: E402
from tool_server import MODEL, needs_structured, structured_backend, tool_model_server  # noqa: E402

pytestmark = pytest.mark.slow

ASK = "What is the weather in Paris?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
# The same tools as chat templates see them (OpenAI's chat shape), for the transformers reference.
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "minItems": 1,
             "maxItems": 2}},
    "required": ["city", "days"], "additionalProperties": False}
CONTENT = FORCED_TEXT.split("</think>", 1)[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # No --tool-call-parser: the template's <tool_call> makes it hermes (tool_parser_choice.py), which is
    # logged at info.
    with tool_model_server(tmp_path_factory.mktemp("responses"), ["--enable-auto-tool-choice"],
                           {"PAGEDLLM_TEST_SERVER_LOG_LEVEL": "info"}) as srv:
        yield srv


def test_the_tool_parser_was_chosen_from_the_template(server: LiveServer) -> None:
    log = Path(server.log_path).read_text(errors="replace")
    assert "tool_parser: hermes (chosen from the model: the chat template writes <tool_call>" in log, log[-3000:]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def _create(client: openai.OpenAI, **kw: Any) -> Any:
    return client.responses.create(model=MODEL, input=kw.pop("input", ASK), temperature=0,
                                   max_output_tokens=kw.pop("max_output_tokens", 300), **kw)


def _summary(resp: Any) -> list[tuple[Any, ...]]:
    """The output items without their ids: what a streamed and a whole response must agree on."""
    out: list[tuple[Any, ...]] = []
    for item in resp.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif item.type == "message":
            out.append(("message", item.role, [(c.type, c.text) for c in item.content]))
        else:
            assert item.type == "function_call"
            out.append(("function_call", item.name, item.arguments))
    return out


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    """One streamed request: (the final response of response.completed, the items reassembled from deltas)."""
    events = list(_create(client, stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed", types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    items: dict[int, list[Any]] = {}
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items) and e.item.status == "in_progress"
            items[e.output_index] = [e.item.type, e.item.id, ""]
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                        "response.function_call_arguments.delta"):
            kind, item_id, _ = items[e.output_index]
            assert e.item_id == item_id
            items[e.output_index][2] += e.delta
        elif e.type == "response.output_item.done":
            assert e.item.id == items[e.output_index][1]
    final = events[-1].response
    assert [i.id for i in final.output] == [items[k][1] for k in sorted(items)]
    rebuilt = []
    for k in sorted(items):
        kind, _, text = items[k]
        item = final.output[k]
        if kind == "reasoning":
            rebuilt.append(("reasoning", text))
        elif kind == "message":
            rebuilt.append(("message", "assistant", [("output_text", text)]))
        else:
            rebuilt.append(("function_call", item.name, text))
    return final, rebuilt


def _prompt_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    ids = make_tokenizer().apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def test_plain_text_with_reasoning(client: openai.OpenAI) -> None:
    resp = _create(client, instructions="Answer briefly.")
    assert resp.object == "response" and resp.status == "completed" and resp.id.startswith("resp_")
    assert _summary(resp) == [("reasoning", REASONING), ("message", "assistant", [("output_text", CONTENT)])]
    assert resp.output_text == CONTENT
    assert resp.usage.input_tokens == _prompt_tokens([{"role": "system", "content": "Answer briefly."},
                                                      {"role": "user", "content": ASK}])
    forced = len(make_tokenizer()(FORCED_TEXT, add_special_tokens=False).input_ids)
    assert resp.usage.output_tokens == forced + 1  # the forced text, then EOS
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    # The same request as a list of message items, with input_text parts.
    items = _create(client, input=[{"role": "system", "content": [{"type": "input_text", "text": "Answer briefly."}]},
                                   {"type": "message", "role": "user", "content": ASK}])
    assert items.usage.input_tokens == resp.usage.input_tokens and items.output_text == CONTENT


def test_streamed_events_reassemble_to_the_whole_response(client: openai.OpenAI) -> None:
    whole = _create(client)
    final, rebuilt = _streamed(client)
    assert rebuilt == _summary(final) == _summary(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The client's own accumulator (it checks that items keep their identity) gives the same text.
    with client.responses.stream(model=MODEL, input=ASK, temperature=0, max_output_tokens=300) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert deltas == streamed.output_text == whole.output_text


def test_auto_tool_call_is_a_function_call_item(client: openai.OpenAI) -> None:
    resp = _create(client, tools=TOOLS)
    assert [i.type for i in resp.output] == ["reasoning", "function_call"]
    call = resp.output[1]
    assert call.name == CALL["name"] and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == CALL["arguments"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    final, rebuilt = _streamed(client, tools=TOOLS)
    assert rebuilt == _summary(final) == _summary(resp)


@needs_structured
def test_required_tool_choice_gives_arguments_valid_against_the_schema(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    resp = _create(client, **kw)
    assert resp.status == "completed", resp
    (call,) = resp.output
    assert call.type == "function_call" and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    final, rebuilt = _streamed(client, **kw)
    assert rebuilt == _summary(final) == _summary(resp)
    named = _create(client, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"})
    (call,) = named.output
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])


def test_tool_loop_with_function_call_output(client: openai.OpenAI) -> None:
    first = _create(client, tools=TOOLS)
    call = next(i for i in first.output if i.type == "function_call")
    turn = [{"role": "user", "content": ASK}, *first.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = _create(client, input=turn, tools=TOOLS)
    assert second.status == "completed"
    # The prompt is the template's rendering of the conversation: the call as the assistant's tool_calls, the
    # result as a tool turn (transformers renders the reference).
    reference = [{"role": "user", "content": ASK},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
                 {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    assert second.usage.input_tokens == _prompt_tokens(reference, CHAT_TOOLS)


@needs_structured
def test_text_format_json_schema_validates(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}}
    resp = _create(client, text=fmt)
    assert resp.status == "completed" and [i.type for i in resp.output] == ["message"], resp
    jsonschema.validate(json.loads(resp.output_text), FORECAST)
    assert resp.text.format.type == "json_schema"
    final, rebuilt = _streamed(client, text=fmt)
    assert rebuilt == _summary(final) == _summary(resp)
    obj = _create(client, text={"format": {"type": "json_object"}}, max_output_tokens=60)
    if obj.status == "completed":  # random weights may fill the budget inside the object
        assert isinstance(json.loads(obj.output_text), dict)
    else:
        assert obj.incomplete_details.reason == "max_output_tokens"


def test_max_output_tokens_cuts_off_as_incomplete(client: openai.OpenAI) -> None:
    resp = _create(client, max_output_tokens=5)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5
    events = list(_create(client, max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_bad_requests_are_400s_naming_the_field(server: LiveServer, client: openai.OpenAI) -> None:
    url = f"{server.url}/v1/responses"
    cases = [
        ({"frobnicate": 1}, "frobnicate"),
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"}]}, "input"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
         "text.format.schema"),
        ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "input": ASK, "max_output_tokens": 4, **extra}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=ASK, previous_response_id="resp_123")
    assert "previous_response_id" in str(err.value)
    assert httpx.get(f"{url}/resp_123", timeout=30).status_code == 404


def test_chat_request_of_keeps_turns_and_reasoning() -> None:
    """The item -> turn mapping on its own: calls join the assistant turn before them, reasoning rides on it."""
    from pagedllm.plugins.server.responses_protocol import ResponsesRequest
    from pagedllm.plugins.server.serving_responses import chat_request_of

    body = ResponsesRequest.model_validate({"instructions": "be brief", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
    ]})
    chat, messages = chat_request_of(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assistant = messages[2]
    assert assistant["content"] == "ok" and assistant["reasoning_content"] == "think"
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [("c1", {"a": 1}), ("c2", {})]
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:]] == [("c2", "two"), ("c1", "one")]
    assert chat.tools is None and chat.response_format is None


def test_langchain_on_the_responses_api(server: LiveServer) -> None:
    """LangChain's ChatOpenAI with use_responses_api: bind_tools, the tool loop (its own input items for the
    call and its result), with_structured_output."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city."""
        return f"18 {unit} in {city}"

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=MODEL, temperature=0,
                                      max_tokens=300, max_retries=0, use_responses_api=True)
    with_tools = llm.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Paris?")
    reply = with_tools.invoke([question])
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [(CALL["name"], CALL["arguments"])]
    result = ToolMessage(get_weather.invoke(reply.tool_calls[0]["args"]), tool_call_id=reply.tool_calls[0]["id"])
    after = with_tools.invoke([question, reply, result])
    assert after.usage_metadata and after.usage_metadata["input_tokens"] > reply.usage_metadata["input_tokens"]
    if not structured_backend():
        return
    from typing import Literal

    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: Literal["Paris", "Tokyo", "Lima"]
        unit: Literal["celsius", "fahrenheit"]

    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(Forecast, method=method).invoke("Weather in Paris?"), Forecast)


@pytest.mark.parametrize("kw", [{}, {"tools": TOOLS}], ids=["text", "tools"])
def test_bodies_and_events_validate_against_the_sdk_types(server: LiveServer, kw: dict[str, Any]) -> None:
    """The client builds its objects without validating them; here pydantic validates the raw JSON against
    `openai.types.responses` (every required field present, every literal right), whole and event by event."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": MODEL, "input": ASK, "temperature": 0, "max_output_tokens": 300, **kw}
    whole = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    Response.model_validate(whole.json())
    events = TypeAdapter(ResponseStreamEvent)
    seen = []
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    for name, data in zip(lines[::2], lines[1::2]):
        assert name.startswith("event: ") and data.startswith("data: ")
        event = events.validate_python(json.loads(data[6:]))
        assert event.type == name[7:]
        seen.append(event.type)
    assert seen[-1] == "response.completed" and len(seen) == len(lines) // 2
