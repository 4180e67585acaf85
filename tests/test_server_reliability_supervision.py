"""Issue 26, engine-core supervision: the core is SIGKILLed under load. In-flight requests fail at once with an
OpenAI-shaped 503 (a stream: an error event, then [DONE]); then by default the server exits non-zero within
seconds (before: it stayed up answering 503 forever, metrics frozen), or with --engine-restarts it respawns
the core and serves again in the same process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")

from test_server_support import LiveServer, live_server, metric  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
BODY = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


async def _kill_core_under_load(srv: LiveServer, streams: int = 2, plain: int = 2) -> list[dict[str, Any]]:
    """Start `streams` streaming and `plain` non-streaming requests, SIGKILL the core once tokens flow, and
    return each request's outcome; all must end within 10 s of the kill."""
    started = asyncio.Event()

    async def stream_one(http: httpx.AsyncClient) -> dict[str, Any]:
        events = []
        async with http.stream("POST", f"{srv.url}/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    started.set()
                    events.append(line[6:])
        return {"kind": "stream", "events": events}

    async def plain_one(http: httpx.AsyncClient) -> dict[str, Any]:
        r = await http.post(f"{srv.url}/v1/completions", json=BODY)
        return {"kind": "plain", "status": r.status_code, "body": r.json(), "headers": r.headers}

    async with httpx.AsyncClient(timeout=60) as http:
        tasks = [asyncio.create_task(stream_one(http)) for _ in range(streams)]
        tasks += [asyncio.create_task(plain_one(http)) for _ in range(plain)]
        await asyncio.wait_for(started.wait(), timeout=60)
        await asyncio.sleep(0.2)  # the non-streaming ones are in the engine too by now
        os.kill(srv.engine_core_pid(), signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        assert time.monotonic() - t0 < 10
        return results


def _assert_clean_503s(results: list[dict[str, Any]]) -> None:
    for res in results:
        if res["kind"] == "stream":
            assert res["events"][-1] == "[DONE]"
            err = json.loads(res["events"][-2])["error"]
            assert err["code"] == "engine_dead" and "engine core died" in err["message"], err
        else:
            assert res["status"] == 503 and res["body"]["error"]["code"] == "engine_dead", res
            assert res["headers"]["retry-after"]


def test_core_death_fails_requests_then_server_exits_nonzero(tiny_root: Path, tmp_path: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    with live_server(["--model", model, "--max-num-seqs", "4"], str(tmp_path / "server.log")) as srv:
        results = asyncio.run(_kill_core_under_load(srv))
        _assert_clean_503s(results)
        t0 = time.monotonic()
        code = srv.proc.wait(15)
        assert code == 1, srv.log()
        assert time.monotonic() - t0 < 10
        assert "no restart is left" in srv.log()
        assert "Traceback" not in srv.log()


def test_core_death_with_restarts_respawns_and_serves_again(tiny_root: Path, tmp_path: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    log = str(tmp_path / "server.log")
    with live_server(["--model", model, "--max-num-seqs", "4", "--engine-restarts", "1"], log) as srv:
        first_core = srv.engine_core_pid()
        results = asyncio.run(_kill_core_under_load(srv))
        _assert_clean_503s(results)
        # Right after the death: unhealthy, gauges zeroed (not frozen at their last values).
        health = httpx.get(f"{srv.url}/health", timeout=10)
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        if health.status_code == 503:  # a fast machine may already have restarted it (backoff 1 s)
            assert health.json()["error"]["code"] == "engine_dead"
            assert metric(text, "pagedllm:engine_healthy") == 0
        assert metric(text, "pagedllm:num_requests_running") == 0
        assert metric(text, "pagedllm:kv_cache_usage_perc") == 0
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 200:
            assert srv.proc.poll() is None, srv.log()
            assert time.monotonic() < deadline, "the engine core was not restarted"
            time.sleep(0.2)
        assert srv.engine_core_pid() != first_core
        r = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text + srv.log()
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "pagedllm:engine_core_restarts_total") == 1
        assert metric(text, "pagedllm:engine_healthy") == 1
        # The one restart is spent: the next death ends the process.
        results = asyncio.run(_kill_core_under_load(srv, streams=1, plain=1))
        _assert_clean_503s(results)
        assert srv.proc.wait(15) == 1
        assert "Traceback" not in srv.log()


def test_tensor_parallel_rank_death_fails_requests_then_server_exits(tiny_root: Path, tmp_path: Path) -> None:
    """A tensor-parallel rank (the core's own child) is SIGKILLed under load: its core fails the step and
    reports Fatal, and the same policy follows: clean 503s, then exit 1."""
    model = make_tiny_model("llama", tiny_root)
    args = ["--model", model, "--max-num-seqs", "4", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "multiproc"]
    with live_server(args, str(tmp_path / "server.log")) as srv:
        core = psutil.Process(srv.engine_core_pid())
        ranks = [p for p in core.children(recursive=True) if any("spawn_main" in c for c in p.cmdline())]
        assert ranks, "no tensor-parallel worker process found under the engine core"

        async def kill_rank_under_load() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=60) as http:
                events: list[str] = []
                started = asyncio.Event()

                async def one() -> dict[str, Any]:
                    async with http.stream("POST", f"{srv.url}/v1/completions",
                                           json={**BODY, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                started.set()
                                events.append(line[6:])
                    return {"kind": "stream", "events": list(events)}

                task = asyncio.create_task(one())
                await asyncio.wait_for(started.wait(), timeout=60)
                ranks[0].kill()
                return [await asyncio.wait_for(task, timeout=60)]

        res = asyncio.run(kill_rank_under_load())[0]
        assert res["events"][-1] == "[DONE]"
        err = json.loads(res["events"][-2])["error"]
        assert err["code"] == "engine_dead" and "rank" in err["message"], err
        assert srv.proc.wait(30) == 1
