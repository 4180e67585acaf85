"""Tool calling and reasoning through the live server, read by the official `openai` client and LangChain.

One server (tests/tool_models.py): a tiny random model whose chat template renders tools and opens `<think>`,
started with `--tool-call-parser hermes --enable-auto-tool-choice` and, through the config's `plugins.openai`
section, `reasoning_parser: deepseek_r1`.

How each test is meaningful with random weights:
- tool_choice "auto" / "none" and plain chat: the `force_text` logits processor plugin makes every
  unconstrained request emit one fixed reasoning-then-hermes-tool-call text (tool_models.FORCED_TEXT), so the
  server's parsers run on exactly what such a model writes; the tests check what the client receives
  against that text, which they did not produce through the server.
- tool_choice "required" and a named function: the processor steps aside and only the structured-output
  grammar built from the tools' schemas stands between random weights and the output, so arguments that
  validate with `jsonschema` against the tool's schema show the constraint at work.
Streamed deltas are reassembled as a client does and compared with the non-streamed response of the same
(greedy) request.
"""

from __future__ import annotations

import json
import os
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
from tool_models import CALL, FORCED_TEXT, REASONING, make_tokenizer, make_tool_model  # noqa: E402
from tool_server import MODEL, needs_structured, tool_model_server  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with tool_model_server(tmp_path_factory.mktemp("tools"), ["--tool-call-parser", "hermes",
                                                               "--enable-auto-tool-choice"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 300), **kw)


def _reassemble(stream: Any) -> dict[str, Any]:
    """A streamed chat response put back together as a client does, checking OpenAI's chunk shape."""
    content, reasoning, finish = "", "", None
    calls: list[dict[str, Any]] = []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                if tc.index == len(calls):  # a new call: its first chunk carries the id, type and name
                    assert tc.id and tc.type == "function" and tc.function and tc.function.name
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""})
                else:
                    assert tc.id is None and tc.function is not None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish": finish,
            "calls": [(c["name"], c["arguments"]) for c in calls]}


def _whole(resp: Any) -> dict[str, Any]:
    message = resp.choices[0].message
    return {"content": message.content or None, "reasoning": (message.model_extra or {}).get("reasoning_content"),
            "finish": resp.choices[0].finish_reason,
            "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []]}


def test_auto_tool_call_and_reasoning(client: openai.OpenAI) -> None:
    resp = _chat(client, tools=TOOLS)
    whole = _whole(resp)
    assert whole["finish"] == "tool_calls"
    assert whole["reasoning"] == REASONING and whole["content"] is None
    (call,) = resp.choices[0].message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == CALL["name"]
    arguments = json.loads(call.function.arguments)
    assert arguments == CALL["arguments"]
    jsonschema.validate(arguments, SCHEMAS["get_weather"])
    streamed = _reassemble(_chat(client, tools=TOOLS, stream=True))
    assert streamed == whole
    # The official client's own stream accumulation gives the same message.
    with client.chat.completions.stream(model=MODEL, messages=ASK, temperature=0, max_tokens=300,  # type: ignore[arg-type]
                                        tools=TOOLS) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or []] == (
        whole["calls"])
    assert final.choices[0].finish_reason == "tool_calls"


def test_tools_are_rendered_by_the_chat_template(client: openai.OpenAI) -> None:
    """The prompt the engine ran is the template's rendering with the tools (token count as transformers')."""
    tok = make_tokenizer()
    with_tools = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    without = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True)
    as_ids = with_tools["input_ids"] if isinstance(with_tools, dict) or hasattr(with_tools, "input_ids") else with_tools
    base = without["input_ids"] if isinstance(without, dict) or hasattr(without, "input_ids") else without
    assert len(as_ids) > len(base)
    assert _chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens == len(as_ids)
    assert _chat(client, max_tokens=1).usage.prompt_tokens == len(base)


def test_tokenize_with_tools_counts_what_chat_renders(server: LiveServer, client: openai.OpenAI) -> None:
    """/tokenize with messages and tools: the tokens chat completions runs (and transformers renders)."""
    tok = make_tokenizer()
    rendered = tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    reference = list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "input_ids")
                     else rendered)
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": ASK, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == reference
    assert r.json()["count"] == _chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    # A tool turn and the assistant's call go through the same rendering as chat's (tool_call_id, arguments).
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": turns, "tools": TOOLS}, timeout=60).json()
    assert counted["count"] == _chat(client, messages=turns, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    bad = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "tools": TOOLS}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_tool_results_round_trip_through_the_template(client: openai.OpenAI) -> None:
    first = _chat(client, tools=TOOLS).choices[0].message
    call = (first.tool_calls or [])[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    resp = _chat(client, messages=messages, tools=TOOLS, max_tokens=1)
    tok = make_tokenizer()
    template_messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    text = tok.apply_chat_template(template_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "18 C, sunny" in text and '"city": "Paris"' in text
    assert resp.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def test_tool_choice_none_leaves_the_text_alone(client: openai.OpenAI) -> None:
    resp = _chat(client, tools=TOOLS, tool_choice="none")
    message = resp.choices[0].message
    assert not message.tool_calls and resp.choices[0].finish_reason == "stop"
    assert (message.model_extra or {}).get("reasoning_content") == REASONING
    assert message.content == FORCED_TEXT.split("</think>", 1)[1]


def test_reasoning_without_tools_streamed_equals_whole(client: openai.OpenAI) -> None:
    whole = _whole(_chat(client))
    assert whole["reasoning"] == REASONING and whole["content"] == FORCED_TEXT.split("</think>", 1)[1]
    assert _reassemble(_chat(client, stream=True)) == whole


def test_bad_tool_requests_are_400s_naming_the_field(server: LiveServer) -> None:
    url = f"{server.url}/v1/chat/completions"
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "x"}], "tools": TOOLS}, "messages"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@needs_structured
def test_required_tool_choice_gives_calls_valid_against_the_schemas(client: openai.OpenAI) -> None:
    """parallel_tool_calls=false: the schema then allows one call, so the grammar ends the array; random
    weights left free to add calls never stop before max_tokens (several-call arrays: test_tool_parsers.py)."""
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    resp = _chat(client, **kw)
    whole = _whole(resp)
    assert whole["finish"] == "tool_calls", (whole, resp.choices[0].message.content)
    assert len(whole["calls"]) == 1
    _check_calls(whole["calls"], set(SCHEMAS))
    assert _reassemble(_chat(client, stream=True, **kw)) == whole


@needs_structured
def test_named_tool_choice_gives_that_call_valid_against_its_schema(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    resp = _chat(client, tools=TOOLS, tool_choice=choice)
    whole = _whole(resp)
    assert len(whole["calls"]) == 1 and whole["finish"] == "tool_calls", resp
    _check_calls(whole["calls"], {"get_time"})
    assert _reassemble(_chat(client, tools=TOOLS, tool_choice=choice, stream=True)) == whole


# -- LangChain ---------------------------------------------------------------------------------------------


def test_langchain_bind_tools(server: LiveServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city."""
        return f"18 {unit} in {city}"

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=MODEL, temperature=0,
                                      max_tokens=300, max_retries=0)
    reply = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert reply.tool_calls[0]["args"] == CALL["arguments"]
    assert get_weather.invoke(reply.tool_calls[0]["args"]) == "18 celsius in Paris"


@needs_structured
def test_langchain_with_structured_output(server: LiveServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from typing import Literal

    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: Literal["Paris", "Tokyo", "Lima"]
        unit: Literal["celsius", "fahrenheit"]

    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=MODEL, temperature=0,
                                      max_tokens=300, max_retries=0)
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(Forecast, method=method).invoke("Weather in Paris?")
        assert isinstance(result, Forecast), (method, result)



# -- without a server: the settings and the 400s that need another server configuration ----------------------


def test_auto_needs_the_flag_and_a_parser() -> None:
    from pagedllm.plugins.server.chat_parsing import ChatParsing
    from pagedllm.plugins.server.errors import APIError
    from pagedllm.plugins.server.protocol import ChatCompletionRequest
    from pagedllm.plugins.server.tools import plan_tools

    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS})
    for parsing in (ChatParsing(), ChatParsing(tool_parser=object, tool_parser_name="x")):
        with pytest.raises(APIError) as err:
            plan_tools(body, parsing)
        assert err.value.status == 400 and err.value.param == "tool_choice"
        assert "--enable-auto-tool-choice" in err.value.message
    assert plan_tools(body.model_copy(update={"tool_choice": "none"}), ChatParsing()).mode == "none"


def test_parser_settings_from_flags_over_the_config_section() -> None:
    from types import SimpleNamespace

    from pagedllm.plugins.server.chat_parsing import ChatParsing

    section = {"tool_call_parser": "mistral", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}
    flags = SimpleNamespace(tool_call_parser="hermes", reasoning_parser=None, enable_auto_tool_choice=None)
    parsing = ChatParsing.from_settings(flags, section)
    assert (parsing.tool_parser_name, parsing.reasoning_parser_name, parsing.enable_auto_tool_choice) == (
        "hermes", "qwen3", True)
    assert parsing.tool_parser.__name__ == "HermesToolParser"
    with pytest.raises(ValueError, match="available: .*hermes.*llama3_json.*mistral.*pythonic"):
        ChatParsing.from_settings(SimpleNamespace(tool_call_parser="hermez"), None)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):  # and the template implies none
        ChatParsing.from_settings(SimpleNamespace(enable_auto_tool_choice=True), None).for_model("{{ messages }}")
    with pytest.raises(ValueError, match="tool_call_parsr"):  # the section's keys are checked too
        ChatParsing.from_settings(None, {"tool_call_parsr": "hermes"})


def test_a_misspelt_parser_stops_serve_before_the_engine_loads(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = make_tool_model(tmp_path)
    result = subprocess.run([sys.executable, "-m", "pagedllm.cli.serve_cmd", "--model", model,
                             "--reasoning-parser", "deepseek"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 2, result.stderr
    assert "--reasoning-parser deepseek: no reasoning_parser named 'deepseek' (available: deepseek_r1, qwen3" in (
        result.stderr)


def _choice_parser(reasoning: str | None, tools: str, strip: str | None = None) -> Any:
    from pagedllm.api import PluginKind
    from pagedllm.api.engine import get_plugin_manager
    from pagedllm.api.parsers import ToolParserContext
    from pagedllm.plugins.server.chat_parsing import ChoiceParser

    pm = get_plugin_manager()
    reasoning_cls = pm.get(PluginKind.REASONING_PARSER, reasoning).resolve() if reasoning else None  # type: ignore[union-attr]
    tool_parser = pm.get(PluginKind.TOOL_PARSER, tools).resolve()(ToolParserContext(None, TOOLS))  # type: ignore[union-attr]
    return ChoiceParser.build(reasoning_cls, None, tool_parser, None, strip)


@pytest.mark.parametrize(("reasoning", "tools", "text", "strip"), [
    ("deepseek_r1", "hermes", FORCED_TEXT, None),
    ("qwen3", "hermes", "<think>hm</think>Sure.<tool_call>" + json.dumps(CALL) + "</tool_call>", None),
    (None, "mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]</s>', "</s>"),
])
def test_reasoning_then_tools_stream_as_the_whole_result_at_every_split(
    reasoning: str | None, tools: str, text: str, strip: str | None
) -> None:
    """The server's per-choice pipeline (reasoning parser, then the tool parser on the content), fed the text
    split in two at every character, gives the whole result; a kept EOS text (`strip`) is never content."""
    whole = _choice_parser(reasoning, tools, strip).parse(text)
    assert whole.tool_calls and (whole.reasoning is None) == (reasoning is None)
    for k in range(len(text) + 1):
        parser = _choice_parser(reasoning, tools, strip)
        pieces = [p for p in (text[:k], text[k:]) if p] or [""]
        deltas = [parser.feed(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        content = "".join(d.content or "" for d in deltas if d)
        reasoning_text = "".join(d.reasoning_content or "" for d in deltas if d)
        calls: list[list[str]] = []
        for piece in [t for d in deltas if d for t in d.tool_calls]:
            if piece.name is not None:
                calls.append([piece.name, piece.arguments or ""])
            else:
                calls[piece.index][1] += piece.arguments or ""
        assert (content or None, reasoning_text or None) == (whole.content, whole.reasoning), k
        assert [tuple(c) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls], k
        assert parser.called
