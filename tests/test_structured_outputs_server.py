"""Structured outputs over HTTP with the official `openai` client: response_format (json_schema strict,
json_object, text) and vLLM's structured_outputs field (regex, choice, grammar) on both endpoints, streamed ==
non-streamed, and invalid constraints as 400s naming the parameter. The model has random weights: only the
grammar makes its output valid (checked with `jsonschema` and `re`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from structured_models import tiny_model_with_tokenizer  # noqa: E402
from test_server_support import LiveServer, live_server  # noqa: E402
from test_structured_outputs import CHOICES, ITEMS, NESTED, PERSON, REGEX  # noqa: E402

MODEL = "tiny-structured"
PROMPTS = ["Describe a user as JSON:", "x", "{"]
MAX_TOKENS = 160

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("structured-server"))
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", model, "--served-model-name", MODEL, "--max-model-len", "1024", "--block-size", "4",
            "--set", "structured_outputs.disable_any_whitespace=true"]
    with live_server(args, str(log)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _chat(client: Any, prompt: str, stream: bool = False, max_tokens: int = MAX_TOKENS,
          **kw: Any) -> tuple[str, str | None]:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
                                                **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _complete(client: Any, prompt: str, stream: bool = False, **kw: Any) -> tuple[str, str | None]:
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("schema", [PERSON, NESTED, ITEMS], ids=["enums", "nested", "array"])
def test_json_schema_strict_validates_and_streams_the_same(client: Any, schema: dict[str, Any]) -> None:
    for prompt in PROMPTS:
        for temperature, seed in ((0.0, None), (1.0, 11)):
            kw = dict(response_format=_schema_format(schema), temperature=temperature, seed=seed)
            text, finish = _chat(client, prompt, **kw)
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)
            assert _chat(client, prompt, stream=True, **kw) == (text, finish)
        # /v1/completions takes response_format too (vLLM does).
        text, finish = _complete(client, prompt, extra_body={"response_format": _schema_format(schema)}, temperature=0)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_parses(client: Any) -> None:
    # Any object: key lengths are open, and most walks of random weights never close a key ("length"); the
    # prompt here is one whose greedy walk closes the object (the mask made "{" then "}" the only choices).
    kw = dict(response_format={"type": "json_object"}, temperature=0.0)
    text, finish = _chat(client, "x", **kw)
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    assert _chat(client, "x", stream=True, **kw) == (text, finish)


def test_response_format_text_is_free(client: Any) -> None:
    free = _chat(client, "x", temperature=0.0, max_tokens=8)
    assert _chat(client, "x", temperature=0.0, max_tokens=8, response_format={"type": "text"}) == free


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_choice_grammar_match_and_stream_the_same(client: Any, endpoint: str) -> None:
    call = _chat if endpoint == "chat" else _complete
    cases = [
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"choice": CHOICES}, lambda t: t in CHOICES),
        ({"grammar": 'root ::= "id=" [0-9] [0-9]? " ok"'}, lambda t: re.fullmatch(r"id=[0-9]{1,2} ok", t)),
        ({"grammar": 'start: "v" NUM "!"\nNUM: /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"v[0-9]{1,3}!", t)),  # Lark
        ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ]
    for so, matches in cases:
        for seed in (1, 2):
            kw = dict(extra_body={"structured_outputs": so}, temperature=1.0, seed=seed)
            text, finish = call(client, "pick one", **kw)
            assert finish == "stop" and matches(text), (so, text)
            assert call(client, "pick one", stream=True, **kw) == (text, finish)


def _bad_request(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_invalid_constraints_are_400_naming_the_parameter(client: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    err = _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=messages, response_format=_schema_format({"type": "objectx"})))
    assert err["param"] == "response_format.json_schema.schema" and "objectx" in err["message"]
    err = _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert err["param"] == "response_format.json_schema.schema"
    err = _bad_request(lambda: client.completions.create(
        model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "a["}}))
    assert err["param"] == "structured_outputs.regex"
    err = _bad_request(lambda: client.completions.create(
        model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}))
    assert err["param"] == "structured_outputs" and "exactly one" in err["message"]
    err = _bad_request(lambda: client.completions.create(
        model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "a", "backend": "nope"}}))
    assert err["param"] == "structured_outputs" and "no structured_output named 'nope'" in err["message"]
    err = _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"regex": "a"}}))
    assert err["param"] == "response_format"
    err = _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "yaml"}))
    assert "response_format" in str(err.get("param")) + err["message"]
