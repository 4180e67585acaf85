"""Disaggregated prefill and decode (issue 27 item 3): a prefill server and a decode server, each its own process
with the `pd` KV connector, behind the `pagedllm disagg` router (a third process).

The reference is one engine: the prefill server itself, asked for the whole completion. Through the router,
the decode server must return the same greedy tokens while its `usage.prompt_tokens_details.cached_tokens`
(and its connector counters) show the prompt's full blocks arrived from the prefill engine; killing the
prefill process while requests are in flight must still complete every request with the same tokens.
Tokens are compared as the server reports them (`logprobs: 0` gives `token_id:N` without a tokenizer).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_support import HOST, LiveServer, free_port, live_server, metric, stop  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

BLOCK = 16
MAX_TOKENS = 10
_rng = random.Random(27)
# Mixed lengths: under one block (nothing to transfer), exactly one block, one block and a token, and
# longer ones ending mid-block and on a block boundary.
PROMPTS = [[_rng.randrange(3, 384) for _ in range(n)] for n in (7, 16, 17, 40, 64, 100, 151)]


def expected_cached(prompt: list[int]) -> int:
    # The decode engine computes at least the last prompt token; the producer ships full blocks only.
    return (len(prompt) - 1) // BLOCK * BLOCK


def engine_args(model: str, role: str, kv_port: int | None = None) -> list[str]:
    args = ["--model", model, "--served-model-name", "tiny", "--block-size", str(BLOCK), "--max-model-len", "256",
            "--set", "kv_transfer.kv_connector=pd", "--set", f"plugins.pd.role={role}"]
    if kv_port is not None:
        args += ["--set", f"plugins.pd.port={kv_port}"]
    return args


@pytest.fixture(scope="module")
def model(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@contextmanager
def both_servers(args_a: list[str], log_a: str, args_b: list[str], log_b: str) -> Iterator[tuple[LiveServer, ...]]:
    """Two live servers started side by side (their start-ups overlap: most of this module's time)."""
    managers = [live_server(args_a, log_a), live_server(args_b, log_b)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
    try:
        yield tuple(f.result() for f in futures)  # the first start-up error, if any, is raised here
    finally:
        for m, f in zip(managers, futures, strict=True):
            if f.exception() is None:
                m.__exit__(None, None, None)


@pytest.fixture(scope="module")
def cluster(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("disagg")
    kv_port = free_port()
    with both_servers(engine_args(model, "kv_producer", kv_port), str(logs / "prefill.log"),
                      engine_args(model, "kv_consumer"), str(logs / "decode.log")) as (prefill, decode):
        port = free_port()
        router_log = open(logs / "router.log", "wb")  # noqa: SIM115 (open for the router's whole life)
        router = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.cli.main", "disagg", "--prefill", prefill.url,
             "--prefill-kv", f"{HOST}:{kv_port}", "--decode", decode.url, "--host", HOST, "--port", str(port),
             "--prefill-timeout", "10", "--log-level", "warning"],
            stdout=router_log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://{HOST}:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert router.poll() is None, (logs / "router.log").read_text()
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "router not up in 60 s"
                time.sleep(0.3)
            yield {"prefill": prefill, "decode": decode, "router": url, "logs": logs}
        finally:
            stop(router)
            router_log.close()


def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, **extra}


def tokens_of(answer: dict[str, Any]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]


def post_all(url: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    def one(prompt: list[int]) -> dict[str, Any]:
        r = httpx.post(f"{url}/v1/completions", json=body(prompt), timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the engines batch them
        return list(pool.map(one, prompts))


def scrape(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


@pytest.fixture(scope="module")
def reference(cluster: dict[str, Any]) -> list[list[int]]:
    """One engine: the prefill server computes each whole completion itself (no transfer parameters)."""
    return [tokens_of(a) for a in post_all(cluster["prefill"].url, PROMPTS)]


def test_prefill_then_decode_gives_one_engines_tokens(cluster: dict[str, Any], reference: list[list[int]]) -> None:
    answers = post_all(cluster["router"], PROMPTS)
    assert [tokens_of(a) for a in answers] == reference
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached == [expected_cached(p) for p in PROMPTS]  # every full block came from the prefill engine
    decode = scrape(cluster["decode"])
    assert metric(decode, "pagedllm:kv_connector_remote_hit_tokens_total") == sum(cached)
    assert metric(decode, "pagedllm:kv_connector_transfer_failures_total") == 0
    stats = httpx.get(f"{cluster['router']}/router/stats", timeout=10).json()
    assert stats["prefilled_remotely"] == len(PROMPTS) and stats["prefill_failures"] == 0
    for server in (cluster["prefill"], cluster["decode"]):
        assert metric(scrape(server), "pagedllm:kv_cache_usage_perc") == 0.0


def test_streamed_through_the_router_with_the_openai_client(cluster: dict[str, Any],
                                                          reference: list[list[int]]) -> None:
    client = openai.OpenAI(base_url=f"{cluster['router']}/v1", api_key="none", max_retries=0)
    prompt = PROMPTS[-1]
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    got: list[int] = []
    chunks, usage = 0, None
    for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].logprobs is not None:
            got += [int(t.removeprefix("token_id:")) for t in chunk.choices[0].logprobs.tokens or []]
        usage = chunk.usage or usage
    assert got == reference[-1]
    assert chunks > 2  # passed through chunk by chunk, not buffered into one answer
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == expected_cached(prompt)


def test_kv_transfer_params_are_the_routers_and_are_validated(cluster: dict[str, Any]) -> None:
    r = httpx.post(f"{cluster['router']}/v1/completions",
                   json=body(PROMPTS[1], kv_transfer_params={"do_remote_decode": True, "transfer_id": "x"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    # On a server: both sides at once is a 400 naming the field, as is a prefill side without an address.
    for bad in ({"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "x"},
                {"do_remote_prefill": True, "transfer_id": "x"}):
        r = httpx.post(f"{cluster['decode'].url}/v1/completions", json=body(PROMPTS[1], kv_transfer_params=bad))
        assert r.status_code == 400 and "kv_transfer_params" in r.text, r.text


def test_killing_the_prefill_process_loses_nothing(cluster: dict[str, Any], reference: list[list[int]]) -> None:
    """Last in the module: it kills the prefill server. Requests in flight, then SIGKILL mid-way: some were
    prefilled and fetched, some lose their prefill server or their transfer; all decode the same tokens."""
    prefill, decode, router = cluster["prefill"], cluster["decode"], cluster["router"]
    prompts = [p + [3 + i] * (BLOCK * 2) for i in range(3) for p in PROMPTS[2:]]  # new prompts: no cache hits
    with ThreadPoolExecutor(4) as pool:  # fewer workers than requests: the kill lands while some wait
        futures = [pool.submit(lambda p=p: httpx.post(f"{router}/v1/completions", json=body(p), timeout=120))
                   for p in prompts]
        futures[0].result()
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        answers = [f.result() for f in futures]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    # The reference for the new prompts: the decode server alone (no transfer parameters, no router).
    assert [tokens_of(a.json()) for a in answers] == [tokens_of(a) for a in post_all(decode.url, prompts)]
    stats = httpx.get(f"{router}/router/stats", timeout=10).json()
    assert stats["prefill_failures"] >= 1, stats  # the kill did land while requests were being routed
    assert metric(scrape(decode), "pagedllm:kv_cache_usage_perc") == 0.0


def test_the_prefill_copy_asks_for_one_token_and_keeps_the_rest() -> None:
    from pagedllm.plugins.commands.disagg.proxy import prefill_body

    body = {"prompt": [5, 6], "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "n": 3,
            "min_tokens": 5, "temperature": 0, "logprobs": 0}
    assert prefill_body(body, "t1") == {
        "prompt": [5, 6], "max_tokens": 1, "stream": False, "n": 1, "temperature": 0, "logprobs": 0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t1"}}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the decode request keeps the client's own
