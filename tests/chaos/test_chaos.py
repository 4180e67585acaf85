"""The chaos suite (issue 26): a mixed load against a live server on loopback while faults are injected; then
every request must have ended with a result or a clean error -- none lost, none hung -- the KV cache must
be empty again, the log free of tracebacks, and SIGTERM must end the rest and the process cleanly.

Load: plain asyncio clients on httpx plus the official `openai` client (a locust / aiperf install would pull
gevent or a large tree into the test environment for what a few coroutines do here). Faults, in one run:

    normal clients   mixed completions: 1-3 prompts, n 1-2, stream or not, 4-48 tokens (httpx and openai)
    slow readers     streams read with pauses
    leavers          clients that give up after 0.1-0.6 s (streaming and not)
    floods           bursts past the waiting bound (429 + Retry-After expected)
    bad input        a corpus of malformed requests (OpenAI-shaped 4xx expected, never 5xx)
    rank kill        SIGKILL of tensor-parallel rank 1 mid-load (the server runs at --tensor-parallel-size 2
                     on the CPU, gloo; 503s, then a restart: --engine-restarts)
    core kill        SIGKILL of the engine core mid-load, in turn with the rank kills (PAGEDLLM_CHAOS_TP=1:
                     one process, core kills only)
    SIGTERM          at the end, with requests in flight (they finish or end with a 503)

Afterwards also: memory flat (the API process's RSS after the load within RSS_GROWTH_MIB of its RSS after a
warm-up) and one restart counted per kill. Small in CI (PAGEDLLM_CHAOS_S, default 8 s of load, one kill: the
rank's; a core kill is in tests/test_server_reliability_supervision.py); by hand, 16 s or more for both:
PAGEDLLM_CHAOS_S=1800 pytest -s tests/chaos.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")
openai = pytest.importorskip("openai")

from test_server_support import LiveServer, live_server, metric  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

DURATION_S = float(os.environ.get("PAGEDLLM_CHAOS_S", "8"))
TP = int(os.environ.get("PAGEDLLM_CHAOS_TP", "2"))
# One kill per 8 s of load. At least one, not two: a tp=2 restart on the 2-core CI machine costs ~10-30 s of the
# suite's time (the chaos phase of 8 s of load, 2026-12-01 15:05-15:10 UTC, load average 6-7: a rank and a core
# kill 62.8 s, one rank kill 29.3 s, the tp=1 suite before with one core kill 18.1 s), and the rank kill is the
# one only this suite makes under a mixed load (core kills: test_server_reliability_supervision.py).
KILLS = max(1, int(DURATION_S // 8))
HANG_S = 60.0  # a request not ended by then is hung
RESTART_S = 180.0  # a core (and its ranks) not serving again by then after a kill did not restart
MAX_NUM_SEQS = 4
MAX_WAITING = 6
BODY_LIMIT = 32768
# Memory flat: the API process's RSS after the load may exceed its RSS after the warm-up by this much. Measured
# on the 2-core CI machine at tp 2 (2026-12-01): +6.4 and +8.4 MiB after 8 s of load (2 kills), +9.9 MiB after
# 40 s (5 kills), the samples at each kill 336, 341, 343, 343, 344 MiB: the growth comes in the first seconds
# (peak concurrency and the first restart's allocations, which the warm-up cannot make without a kill), then
# stops. 24 MiB is 2.4x the largest of those; a leak of a few KiB per request or ~100 KiB per restart crosses it
# within a 30-minute run (117,199 requests, 225 restarts at tp 1).
RSS_GROWTH_MIB = 24.0


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(rng.randrange(2, 24))]


BAD_INPUTS: list[tuple[str, Any]] = [
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [[]]}),
    ("/v1/completions", {"prompt": "text, but this model has no tokenizer"}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": -1}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}),
    ("/v1/completions", {"prompt": [10**7]}),
    ("/v1/completions", {"prompt": [1, 2], "model": "not-this-one"}),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [-1]}),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 10**4}),
    ("/v1/completions", {"prompt": [1, 2], "stream": True, "max_tokens": 0}),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["x" * (BODY_LIMIT + 10)]}),  # 413
    ("/v1/completions", "{not json"),
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "no chat template here"}]}),
    ("/detokenize", {"tokens": [-5]}),
    ("/tokenize", {}),
]


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    left: int = 0  # the client gave up on purpose
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    rss_warm: int = 0  # the API process, after the warm-up
    rss_at_end: int = 0  # the API process, after the load and before SIGTERM
    rss_samples: list[int] = field(default_factory=list)  # at each kill, to see a trend in a long run
    restart_s: list[float] = field(default_factory=list)  # from each kill to /health 200 again
    warm_up_s: float = 0.0

    def report(self) -> str:
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"
        return (f"sent {self.sent} / completed {self.completed} / left by the client {self.left} / clean errors "
                f"{sum(self.errors.values())} ({errs}) / lost {len(self.lost)} / hung {len(self.hung)}")


def _clean_error(r: httpx.Response) -> str | None:
    """'STATUS code' for an OpenAI-shaped JSON error, else None."""
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= err.keys():
        return None
    if r.status_code in (429, 503) and "retry-after" not in r.headers:
        return None
    return f"{r.status_code} {err['code']}"


class Load:
    def __init__(self, srv: LiveServer, seed: int) -> None:
        self.srv, self.rng, self.tally = srv, random.Random(seed), Tally()
        self.stop = asyncio.Event()

    async def track(self, label: str, work: Coroutine[Any, Any, str]) -> None:
        """Run one request; `work` returns 'ok', 'left' or an error tally key, or raises for a lost one."""
        self.tally.sent += 1
        try:
            outcome = await asyncio.wait_for(work, timeout=HANG_S)
        except TimeoutError:
            self.tally.hung.append(label)
            return
        except Exception as exc:  # a connection reset, a malformed stream: the request was lost
            self.tally.lost.append(f"{label}: {type(exc).__name__}: {exc}")
            return
        if outcome == "ok":
            self.tally.completed += 1
        elif outcome == "left":
            self.tally.left += 1
        else:
            self.tally.errors[outcome] += 1
            if outcome.startswith(("429", "503")):
                # As a client honouring Retry-After would (a fraction of it, to keep the pressure up).
                await asyncio.sleep(0.3)

    def body(self, stream: bool) -> dict[str, Any]:
        rng = self.rng
        k = rng.choice([1, 1, 2, 3])
        prompt: Any = _prompt(rng) if k == 1 else [_prompt(rng) for _ in range(k)]
        return {"prompt": prompt, "n": rng.choice([1, 1, 2]), "max_tokens": rng.randrange(4, 48),
                "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1000), "ignore_eos": True,
                "stream": stream}

    async def completion(self, http: httpx.AsyncClient, body: dict[str, Any], pause_s: float = 0.0,
                         leave_after_s: float | None = None) -> str:
        url = f"{self.srv.url}/v1/completions"
        want = (len(body["prompt"]) if isinstance(body["prompt"][0], list) else 1) * body["n"]
        t0 = time.monotonic()
        if not body["stream"]:
            try:
                r = await asyncio.wait_for(http.post(url, json=body), leave_after_s) if leave_after_s \
                    else await http.post(url, json=body)
            except TimeoutError:
                return "left"
            if r.status_code == 200:
                choices = r.json()["choices"]
                assert len(choices) == want and all(c["finish_reason"] == "length" for c in choices), r.text
                return "ok"
            return _clean_error(r) or _lost(f"{r.status_code} {r.text[:200]}")
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _clean_error(r) or _lost(f"{r.status_code} {r.text[:200]}")
            finished: set[int] = set()
            events: list[str] = []
            async for line in r.aiter_lines():
                if leave_after_s is not None and time.monotonic() - t0 > leave_after_s:
                    return "left"
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if pause_s:
                    await asyncio.sleep(pause_s)
                if events[-1] != "[DONE]":
                    chunk = json.loads(events[-1])
                    if "error" not in chunk:
                        finished |= {c["index"] for c in chunk["choices"] if c["finish_reason"]}
            if not events or events[-1] != "[DONE]":
                raise AssertionError(f"stream ended without [DONE] after {len(events)} events")
            if len(events) >= 2 and "error" in (last := json.loads(events[-2])):
                return f"stream {last['error']['code']}"
            assert len(finished) == want, (finished, want)
            return "ok"

    async def normal(self, http: httpx.AsyncClient, client: Any) -> None:
        while not self.stop.is_set():
            if self.rng.random() < 0.3:
                await self.track("openai", self.with_openai(client))
            else:
                body = self.body(stream=self.rng.random() < 0.5)
                await self.track("normal", self.completion(http, body))

    async def with_openai(self, client: Any) -> str:
        try:
            resp = await client.completions.create(model="tiny", prompt=_prompt(self.rng), max_tokens=8,
                                                   temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            return _clean_error(exc.response) or _lost(str(exc))
        assert resp.choices[0].finish_reason == "length"
        return "ok"

    async def slow_reader(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            await self.track("slow", self.completion(http, self.body(stream=True), pause_s=0.05))

    async def leaver(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            body = {**self.body(stream=self.rng.random() < 0.5), "max_tokens": 300}
            await self.track("leaver", self.completion(http, body, leave_after_s=self.rng.uniform(0.1, 0.6)))

    async def flood(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            body = {**self.body(stream=False), "n": 1, "max_tokens": 40}
            await asyncio.gather(*(self.track("flood", self.completion(http, dict(body)))
                                   for _ in range(3 * (MAX_NUM_SEQS + MAX_WAITING))))
            await asyncio.sleep(1.0)

    async def bad_one(self, http: httpx.AsyncClient, path: str, body: Any) -> str:
        kw: dict[str, Any] = {"content": body} if isinstance(body, str) else {"json": body}
        r = await http.post(f"{self.srv.url}{path}", headers={"content-type": "application/json"}, **kw)
        key = _clean_error(r)
        # 503: while the core is down or restarting, that is checked before the request is.
        if key is None or not (400 <= r.status_code < 500 or key == "503 engine_dead"):
            return _lost(f"bad input {path} {body!r:.80}: {r.status_code} {r.text[:200]}")
        return key

    async def bad_input(self, http: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            path, body = self.rng.choice(BAD_INPUTS)
            await self.track("bad", self.bad_one(http, path, body))
            await asyncio.sleep(0.05)

    async def warm_up(self, http: httpx.AsyncClient, client: Any) -> None:
        """Every kind of request once, without faults, so that first-use allocations (imports, compiled
        validators, the tokenizer's caches, connection pools) are made before the baseline RSS is read."""
        for path, body in BAD_INPUTS:
            await self.track("warm-up", self.bad_one(http, path, body))
        short = 4  # the paths matter here, not the number of tokens
        await asyncio.gather(
            self.track("warm-up", self.completion(http, {**self.body(stream=False), "max_tokens": short})),
            self.track("warm-up", self.completion(http, {**self.body(stream=True), "max_tokens": short})),
            self.track("warm-up", self.completion(http, {**self.body(stream=True), "max_tokens": short},
                                                  pause_s=0.05)),
            self.track("warm-up", self.with_openai(client)),
            *(self.track("warm-up", self.completion(http, {**self.body(stream=s), "max_tokens": 300},
                                                    leave_after_s=0.3)) for s in (False, True)),
        )
        flood = {**self.body(stream=False), "n": 1, "max_tokens": short}
        await asyncio.gather(*(self.track("warm-up", self.completion(http, dict(flood)))
                               for _ in range(3 * (MAX_NUM_SEQS + MAX_WAITING))))


def _lost(why: str) -> str:
    raise AssertionError(why)


async def _engine_idle(url: str, within_s: float) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        deadline = time.monotonic() + within_s
        while True:
            text = (await http.get(f"{url}/metrics")).text
            busy = [metric(text, n) for n in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                                              "pagedllm:kv_cache_usage_perc")]
            if busy == [0, 0, 0] and (await http.get(f"{url}/health")).status_code == 200:
                return
            assert time.monotonic() < deadline, f"not idle {within_s}s after the load: {busy}"
            await asyncio.sleep(0.1)


async def _healthy(http: httpx.AsyncClient, url: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (await http.get(f"{url}/health")).status_code != 200:
        assert time.monotonic() < deadline, f"the server did not become healthy within {within_s}s"
        await asyncio.sleep(0.1)


async def _time_restart(http: httpx.AsyncClient, url: str, into: list[float]) -> None:
    """Seconds from now (the kill) until /health has turned 503 and then 200 again."""
    t0, seen_down = time.monotonic(), False
    while time.monotonic() - t0 < RESTART_S:
        up = (await http.get(f"{url}/health")).status_code == 200
        if seen_down and up:
            into.append(time.monotonic() - t0)
            return
        seen_down |= not up
        await asyncio.sleep(0.1)


async def _chaos(srv: LiveServer) -> Tally:
    load = Load(srv, seed=int(os.environ.get("PAGEDLLM_CHAOS_SEED", "26")))
    # Idle connections expire here before uvicorn's 5 s keep-alive timeout closes them: at equal timeouts
    # (httpx's default) a request can go out on a connection the server is closing (a ReadError; 2 in
    # 117,199 requests in a 30-minute run), the HTTP/1.1 race every client pool must stay clear of.
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=HANG_S, limits=limits) as http:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=HANG_S)
        api = psutil.Process(srv.proc.pid)
        t0 = time.monotonic()
        await load.warm_up(http, client)
        await _engine_idle(srv.url, within_s=30)
        load.tally.rss_warm = api.memory_info().rss
        load.tally.warm_up_s = time.monotonic() - t0
        workers = [load.normal(http, client) for _ in range(4)] + [load.slow_reader(http), load.leaver(http),
                                                                  load.leaver(http), load.flood(http),
                                                                  load.bad_input(http)]
        tasks = [asyncio.create_task(w) for w in workers]
        # The kills, evenly spread, each a while after the last restart: (tp > 1) tensor-parallel rank 1, then
        # the engine core, in turn.
        for i in range(KILLS):
            await asyncio.sleep(DURATION_S / (KILLS + 1))
            # A serving core, not one still restarting (a tp=2 restart on a shared 2-core machine: up to ~50 s).
            await _healthy(http, srv.url, within_s=RESTART_S)
            load.tally.rss_samples.append(api.memory_info().rss)
            tasks.append(asyncio.create_task(_time_restart(http, srv.url, load.tally.restart_s)))
            if TP > 1 and i % 2 == 0:
                srv.tp_ranks()[0].kill()
                print(f"chaos: killed tensor-parallel rank 1 ({i + 1}/{KILLS})")
            else:
                os.kill(srv.engine_core_pid(), signal.SIGKILL)
                print(f"chaos: killed the engine core ({i + 1}/{KILLS})")
        await asyncio.sleep(DURATION_S / (KILLS + 1))
        load.stop.set()
        await asyncio.gather(*tasks)
        await _engine_idle(srv.url, within_s=RESTART_S)
        load.tally.rss_at_end = api.memory_info().rss
        restarts = metric((await http.get(f"{srv.url}/metrics")).text, "pagedllm:engine_core_restarts_total")
        assert restarts == KILLS, f"{KILLS} kills but {restarts} restarts"  # each death seen, each recovered
        # The end: SIGTERM with requests in flight; each finishes or ends with a clean 503.
        final = [asyncio.create_task(load.track("at-sigterm", load.completion(
            http, {**load.body(stream=i % 2 == 0), "max_tokens": 200}))) for i in range(MAX_NUM_SEQS)]
        await asyncio.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*final)
        await client.close()
    return load.tally


def test_chaos(tiny_root: Path, tmp_path: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    log = tmp_path / "server.log"
    args = ["--model", model, "--served-model-name", "tiny", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-waiting", str(MAX_WAITING), "--engine-restarts", str(KILLS), "--tensor-parallel-size", str(TP),
            "--request-timeout", "30", "--drain-timeout", "3", "--max-body-bytes", str(BODY_LIMIT)]
    with live_server(args, str(log)) as srv:
        t0 = time.monotonic()
        tally = asyncio.run(_chaos(srv))
        mib = 2**20
        print(f"\nchaos ({DURATION_S:.0f} s of load, tp {TP}, {KILLS} kills, {time.monotonic() - t0:.1f} s in all: "
              f"warm-up {tally.warm_up_s:.1f} s, kill to serving again {', '.join(f'{t:.1f}' for t in tally.restart_s)} s): "
              f"{tally.report()}; API process RSS after warm-up {tally.rss_warm / mib:.1f} -> after the load "
              f"{tally.rss_at_end / mib:.1f} MiB (at each kill: {', '.join(f'{r / mib:.0f}' for r in tally.rss_samples)})")
        assert srv.proc.wait(30) == 0
    assert not tally.lost, tally.lost[:20]
    assert not tally.hung, tally.hung[:10]
    assert tally.completed > 0
    codes = set(tally.errors)
    assert "429 queue_full" in codes, codes  # the floods went past the bound
    assert any("engine_dead" in c for c in codes), codes  # the kill was felt, and reported cleanly
    assert any(c.startswith("400") for c in codes), codes
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
    if TP > 1:
        assert "tensor-parallel rank 1" in text, text[-4000:]  # the rank kill was seen as such
    growth = (tally.rss_at_end - tally.rss_warm) / 2**20
    assert growth <= RSS_GROWTH_MIB, f"API process RSS grew {growth:.1f} MiB over the load"
