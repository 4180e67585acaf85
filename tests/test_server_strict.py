"""The request surface over HTTP, with the official `openai` client against a live server (the embedded
SmolLM2): the sampling fields (logit_bias, allowed_token_ids, bad_words, prompt_logprobs, vllm_xargs reaching a
logits-processor plugin), honest 400s for fields the server does not implement, and OpenAI's strict JSON types.

The server runs the example package's `ban_tokens` logits processor (installed with pip, as a user would),
so `vllm_xargs` is seen arriving at a real plugin. Greedy, short generations only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("zmq")

import openai  # noqa: E402
from test_server_support import LiveServer, live_server  # noqa: E402

API_KEY = "sk-strict"
MAX_MODEL_LEN = 256
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "pagedllm-example-plugins"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("server_strict")
    site, src = root / "site", root / "pkg"
    shutil.copytree(EXAMPLES, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = root / "engine.yaml"
    config.write_text("logits_processors: [ban_tokens]\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *([old] if old else [])])
    try:
        args = ["--config", str(config), "--model", default_gguf, "--served-model-name", "smollm2",
                "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN)]
        with live_server(args, str(root / "server.log")) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def offline(default_gguf: str) -> Iterator[Any]:
    """The same model in-process (`LLM`), for "offline works the same as over HTTP"."""
    from pagedllm import LLM

    llm = LLM(default_gguf, max_model_len=MAX_MODEL_LEN, num_threads=1)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def _ids(server: LiveServer, text: str) -> list[int]:
    r = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _greedy(client: openai.OpenAI, max_tokens: int = 1, **extra: Any) -> openai.types.Completion:
    return client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                     logprobs=0, extra_body=extra or None)


def _first_token(client: openai.OpenAI, **extra: Any) -> str:
    out = _greedy(client, **extra)
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.tokens
    return out.choices[0].logprobs.tokens[0]


def test_logit_bias_minus_100_on_the_greedy_token_changes_it(client: openai.OpenAI, server: LiveServer) -> None:
    first = _first_token(client)
    (token_id,) = _ids(server, first)
    biased = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0.0, logprobs=0,
                                       logit_bias={str(token_id): -100})
    assert biased.choices[0].logprobs is not None
    assert biased.choices[0].logprobs.tokens[0] != first
    # Chat takes it too.
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, temperature=0.0,  # type: ignore[arg-type]
                                          logprobs=True)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    chat_first = chat.choices[0].logprobs.content[0].token
    (chat_id,) = _ids(server, chat_first)
    again = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, temperature=0.0,  # type: ignore[arg-type]
                                           logprobs=True, logit_bias={str(chat_id): -100})
    assert again.choices[0].logprobs is not None and again.choices[0].logprobs.content
    assert again.choices[0].logprobs.content[0].token != chat_first


def test_allowed_token_ids_restrict_the_output(client: openai.OpenAI, server: LiveServer) -> None:
    allowed = sorted({*_ids(server, " Paris"), *_ids(server, " London"), *_ids(server, " and")})
    names = {httpx.post(f"{server.url}/detokenize", json={"tokens": [t]},
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()["prompt"] for t in allowed}
    for temperature in (0.0, 1.0):
        out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=temperature,
                                        logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        assert out.choices[0].logprobs is not None
        tokens = out.choices[0].logprobs.tokens
        assert len(tokens) == 6 and set(tokens) <= names, (tokens, names)


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    plain = _greedy(client, max_tokens=8).choices[0].text
    word = max(plain.split(), key=len).strip(".,")
    assert word
    banned = _greedy(client, max_tokens=8, bad_words=[word]).choices[0].text
    assert word not in banned and banned != plain


def test_vllm_xargs_reach_the_logits_processor_plugin(client: openai.OpenAI, server: LiveServer) -> None:
    first = _first_token(client)
    (token_id,) = _ids(server, first)
    # ban_tokens (examples/pagedllm-example-plugins) reads SamplingParams.extra_args["ban_token_ids"].
    assert _first_token(client, vllm_xargs={"ban_token_ids": [token_id]}) != first


def test_prompt_logprobs_over_http_equal_offline(client: openai.OpenAI, server: LiveServer, offline: Any) -> None:
    from pagedllm import SamplingParams

    ids = _ids(server, PROMPT)
    body = {"model": "smollm2", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["prompt_logprobs"]
    assert len(served) == len(ids) and served[0] is None
    local = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                       prompt_logprobs=2), use_tqdm=False)[0]
    assert local.prompt_logprobs is not None
    for pos in range(1, len(ids)):
        want, got = local.prompt_logprobs[pos], served[pos]
        assert want is not None and str(ids[pos]) in got
        assert {int(k) for k in got} == set(want)
        for tid, lp in want.items():
            assert got[str(tid)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert got[str(tid)]["rank"] == lp.rank and got[str(tid)]["decoded_token"] == lp.decoded_token
    # Chat: at the response level (vLLM's shape), one entry per prompt token of the templated conversation.
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1, temperature=0.0,  # type: ignore[arg-type]
                                          extra_body={"prompt_logprobs": 0})
    chat_plp = chat.model_extra["prompt_logprobs"] if chat.model_extra else None
    assert chat_plp and chat_plp[0] is None and len(chat_plp) == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(len(pos) == 1 or len(pos) == 2 for pos in chat_plp[1:])


@pytest.mark.parametrize(
    "fields",
    [
        {"logit_bias": {"504": 8.0, "30": -100.0}},
        {"allowed_token_ids": [30, 504, 6123, 28], "ignore_eos": True},
        {"bad_words": ["Paris", " the"]},
        {"min_tokens": 6, "ignore_eos": True, "logit_bias": {"2": 30.0}},
        {"truncate_prompt_tokens": 3},
        {"stop_token_ids": [13], "temperature": 0.8, "seed": 7},
    ],
)
def test_offline_generate_matches_http_for_the_fields(server: LiveServer, offline: Any, fields: dict[str, Any]) -> None:
    from pagedllm import SamplingParams

    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, **fields}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    kw = {k: v for k, v in body.items() if k not in ("model", "prompt")}
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    local = offline.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0]
    assert r.json()["choices"][0]["text"] == local.outputs[0].text


def test_responses_api_answers_as_chat_does(client: openai.OpenAI) -> None:
    """/v1/responses on the model's own template: the same greedy answer and prompt as chat completions
    (tests/test_server_responses.py covers the rest); nothing is stored, so retrieving is a clear 404."""
    resp = client.responses.create(model="smollm2", input=CHAT[0]["content"], max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and chat.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(resp.id)
    body = info.value.body
    assert isinstance(body, dict) and "keeps no responses" in body["message"]  # the client unwraps "error"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Fields the server does not implement: named, not dropped.
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "frobnicate": True}, "frobnicate"),
        ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy"}}, "audio"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
        # OpenAI's JSON types, strictly.
        ("/v1/completions", {"prompt": "x", "n": 15.0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": True}, "n"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": [[False]]}, "prompt"),
        ("/v1/completions", {"prompt": [True, 5]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "seed": 356.0}, "seed"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": "true"}, "logprobs"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        # Token ids: non-negative and inside the vocabulary, everywhere.
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**12]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10**12]}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": [5, -3]}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**12]}, "tokens"),
        # vLLM's rules for the extensions.
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt": "x", "bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server: LiveServer, path: str, body: dict[str, Any],
                                                param: str) -> None:
    r = _post(server, path, {"max_tokens": 2, **body} if path != "/detokenize" else body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


def test_unknown_field_through_the_official_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, extra_body={"guided_json": {}})
    assert info.value.param == "guided_json"  # type: ignore[attr-defined]
    assert "does not implement" in info.value.message
