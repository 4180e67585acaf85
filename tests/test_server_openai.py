"""The OpenAI-compatible server against the official `openai` client, on loopback, with the embedded model.

One server per module (model loading dominates on two shared cores); every generation is greedy and short.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("zmq")

import openai  # noqa: E402
from test_server_support import LiveServer, live_server, metric  # noqa: E402

API_KEY = "sk-test-key"
PROMPTS = ["Hello, my name is", "The capital of France is"]
CHAT = [{"role": "user", "content": "Say hi."}]
MAX_TOKENS = 6
MAX_MODEL_LEN = 512

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", default_gguf, "--served-model-name", "smollm2", "--api-key", API_KEY,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", "65536"]
    with live_server(args, str(log)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline(default_gguf: str) -> dict[str, list[str]]:
    """Greedy reference texts from the offline, in-process `LLM` (built once, then freed)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(default_gguf, max_model_len=MAX_MODEL_LEN, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    completions = LLM.texts(llm.generate(PROMPTS, params, use_tqdm=False))
    chat = LLM.texts(llm.chat(CHAT, params, use_tqdm=False))
    llm.engine.shutdown()
    return {"completions": completions, "chat": chat}


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_api_key(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.get(f"{server.url}/v1/models", headers=_headers(), timeout=10)
    assert ok.status_code == 200
    assert ok.json()["data"][0]["id"] == "smollm2"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # probes need no key


def test_completions_stream_equals_nonstream_equals_offline(client: openai.OpenAI, offline: dict[str, list[str]]) -> None:
    resp = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    texts = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    assert texts == offline["completions"]
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)
    for prompt, expected in zip(PROMPTS, texts):
        stream = client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert "".join(pieces) == expected
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == MAX_TOKENS


def test_chat_stream_equals_nonstream_equals_offline(client: openai.OpenAI, offline: dict[str, list[str]]) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
    text = resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant"
    assert text == offline["chat"][0]
    stream = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_raw_sse_ends_with_done(server: LiveServer) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=_headers(), timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_chat_n_and_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=3, temperature=0, n=2, logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].message.content == resp.choices[1].message.content  # greedy: same text
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and len(content[0].top_logprobs) == 2


def test_32_concurrent_streams_and_metrics(server: LiveServer, offline: dict[str, list[str]]) -> None:
    before = metric(httpx.get(f"{server.url}/metrics", timeout=10).text, "pagedllm:request_success_total")

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def burst() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=300, max_retries=0)
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, PROMPTS[i % 2]) for i in range(32))), timeout=600
            )
        finally:
            await aclient.close()

    texts = asyncio.run(burst())
    assert texts == [offline["completions"][i % 2] for i in range(32)]
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert metric(text, "pagedllm:request_success_total") - before >= 32
    assert metric(text, "pagedllm:generation_tokens_total") >= 32 * MAX_TOKENS
    assert metric(text, "pagedllm:time_to_first_token_seconds_count") >= 32
    for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:prefix_cache_hit_rate", "pagedllm:num_preemptions_total", "pagedllm:prompt_tokens_total",
                 "pagedllm:inter_token_latency_seconds_count", "pagedllm:e2e_request_latency_seconds_count"):
        metric(text, name)


def test_disconnect_mid_stream_frees_kv(server: LiveServer) -> None:
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, headers=_headers()) as http:
        for _ in range(3):
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"text"' in line:
                        break  # got tokens: the request holds KV blocks; now hang up
        deadline = time.monotonic() + 60
        while True:
            text = http.get(f"{server.url}/metrics").text
            usage = metric(text, "pagedllm:kv_cache_usage_perc")
            running = metric(text, "pagedllm:num_requests_running")
            if usage == 0.0 and running == 0.0:
                break
            assert time.monotonic() < deadline, f"KV usage stuck at {usage} with {running} running"
            time.sleep(0.5)
        assert 'finished_reason="abort"' in text  # the hang-ups were recorded as aborted requests


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, "model"),
        ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(server: LiveServer, path: str, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, headers=_headers(), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_body_size_limit(server: LiveServer) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 100_000}, headers=_headers(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_tokenize_detokenize(server: LiveServer) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=_headers(), timeout=30)
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) > 0
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, headers=_headers(), timeout=30)
    assert d.status_code == 200 and d.json()["prompt"] == "Hello world"
