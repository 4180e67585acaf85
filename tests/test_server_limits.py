"""Queue bound and engine-core death, on a tiny random model (no tokenizer: prompts are token ids).

The module's server is killed (its engine core) by the last test, so the queue test runs first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
pytest.importorskip("psutil")

from test_server_support import LiveServer, live_server  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

MAX_NUM_SEQS = 2
MAX_WAITING = 2
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def server(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = make_tiny_model("llama", tiny_root)
    log = tmp_path_factory.mktemp("server_limits") / "server.log"
    args = ["--model", model, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING),
            "--served-model-name", "tiny"]
    with live_server(args, str(log)) as srv:
        yield srv


def _body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream}


def test_queue_bound_rejects_excess_and_completes_accepted(server: LiveServer) -> None:
    burst = 10

    async def one(http: httpx.AsyncClient) -> tuple[int, dict]:
        r = await http.post(f"{server.url}/v1/completions", json=_body(200))
        return r.status_code, r.json()

    async def run() -> list[tuple[int, dict]]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http) for _ in range(burst))), timeout=600)

    results = asyncio.run(run())
    codes = sorted(code for code, _ in results)
    accepted = [body for code, body in results if code == 200]
    rejected = [body for code, body in results if code != 200]
    assert set(codes) <= {200, 429, 503}, codes
    assert len(accepted) >= MAX_NUM_SEQS  # at least the running slots are always accepted
    assert len(accepted) <= MAX_NUM_SEQS + MAX_WAITING
    assert rejected, f"a burst of {burst} against a bound of {MAX_NUM_SEQS + MAX_WAITING} rejected nothing"
    assert all(b["error"]["code"] == "queue_full" for b in rejected)
    for body in accepted:
        assert body["usage"]["completion_tokens"] == 200
        assert body["choices"][0]["finish_reason"] == "length"


def test_engine_core_death_fails_pending_fast_and_health_reports(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    results: list[str] = []

    async def stream_one(http: httpx.AsyncClient, started: asyncio.Event) -> None:
        async with http.stream("POST", f"{server.url}/v1/completions", json=_body(400, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    started.set()
                    results.append(line)

    async def run() -> float:
        async with httpx.AsyncClient(timeout=60) as http:
            # Kill only once every stream is running: on a loaded machine a request still on its way would
            # otherwise meet the dead engine at admission (a 503), which is the other half of this test.
            started = [asyncio.Event() for _ in range(MAX_NUM_SEQS)]
            tasks = [asyncio.create_task(stream_one(http, ev)) for ev in started]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), timeout=120)
            os.kill(server.engine_core_pid(), signal.SIGKILL)
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            return time.monotonic() - t0

    elapsed = asyncio.run(run())
    assert elapsed < 10, f"pending streams took {elapsed:.1f}s to fail"
    errors = [line for line in results if '"error"' in line]
    assert errors and "engine core died" in errors[0]
    assert results[-1] == "data: [DONE]"
    # Then, with the default restart policy (none), the server exits 1 within seconds (issue 26), so an
    # orchestrator restarts it; until then it answers 503.
    try:
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    except httpx.ConnectError:
        pass  # already gone
    assert server.proc.wait(15) == 1
