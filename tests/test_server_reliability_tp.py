"""Issue 26, a tensor-parallel rank's death: `pagedllm serve --tensor-parallel-size 2` on the CPU (gloo), with
rank 1 a local process (`multiproc`) or a Ray actor (`ray`, on a small local cluster of this test's), whose
process is SIGKILLed.

Under load: every in-flight request fails at once with the OpenAI-shaped 503 (a stream: an error event, then
[DONE]) naming the rank, /health answers 503, and with `--engine-restarts 1` a fresh core (and fresh ranks)
serves again. At rest: the death is found within seconds, not at the next request (before: /health kept
answering 200 until a request's step failed), and with the restart budget spent the server exits 1.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")

from test_server_support import LiveServer, live_server, metric  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

BODY = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
# The core asks its executor every 1 s when idle and the API process reads its Fatal within 0.2 s (about 1 s
# seen on this 2-core machine, Ray included); 10 s leaves room for a machine shared with other jobs, and is
# still far from "found at the next request" (never, in this test).
DETECT_AT_REST_S = 10.0
RESTART_S = 180.0  # a tp=2 restart on a 2-core machine shared with other jobs took up to ~50 s


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A small local Ray cluster (2 CPUs: one for rank 1's actor, one spare) the server's core joins."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=0, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


def _rank_processes(srv: LiveServer, backend: str) -> list[Any]:
    """Rank 1's process: the core's spawned child (multiproc), or the Ray worker hosting the actor (ray)."""
    if backend == "multiproc":
        return srv.tp_ranks()
    found = []
    for proc in psutil.process_iter():
        try:  # Ray titles a worker after its actor: "ray::TPWorkerActor", "ray::TPWorkerActor.execute"
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith("ray::TPWorkerActor"):
                found.append(proc)
        except psutil.Error:
            continue
    return found


async def _kill_rank_under_load(srv: LiveServer, rank: Any) -> list[dict[str, Any]]:
    """Two streams and two plain requests in flight, rank 1 SIGKILLed once tokens flow; every request must
    end within 10 s of the kill."""
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
        tasks = [asyncio.create_task(stream_one(http)) for _ in range(2)]
        tasks += [asyncio.create_task(plain_one(http)) for _ in range(2)]
        await asyncio.wait_for(started.wait(), timeout=60)
        await asyncio.sleep(0.2)  # the plain ones are in the engine too by now
        rank.kill()
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        assert time.monotonic() - t0 < 10, "in-flight requests did not fail promptly"
        return results


def _assert_rank_death_503s(results: list[dict[str, Any]]) -> None:
    for res in results:
        if res["kind"] == "stream":
            assert res["events"][-1] == "[DONE]", res["events"][-3:]
            err = json.loads(res["events"][-2])["error"]
        else:
            assert res["status"] == 503, res
            assert res["headers"]["retry-after"]
            err = res["body"]["error"]
        assert err["code"] == "engine_dead" and err["type"] and "param" in err, err
        # "tensor-parallel rank 1 (pid N, exit code -9) died during a step", "... rank 1 (Ray actor) failed"
        assert "tensor-parallel rank 1 (" in err["message"], err["message"]


def _wait_healthy(srv: LiveServer, within_s: float) -> None:
    """Until /health answers 200 (the server must stay up meanwhile)."""
    deadline = time.monotonic() + within_s
    while httpx.get(f"{srv.url}/health", timeout=10).status_code != 200:
        assert srv.proc.poll() is None, srv.log()
        assert time.monotonic() < deadline, f"not healthy again within {within_s}s:\n{srv.log()}"
        time.sleep(0.2)


def _unhealthy_after(srv: LiveServer, within_s: float) -> None:
    """/health turns 503 engine_dead within `within_s` (or the server is already on its way out)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            r = httpx.get(f"{srv.url}/health", timeout=10)
        except httpx.TransportError:  # already closing its socket to exit: it noticed (the log is checked)
            return
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "engine_dead", r.text
            return
        assert time.monotonic() < deadline, f"a rank that died at rest went unnoticed for {within_s}s"
        time.sleep(0.1)


@pytest.mark.slow  # two tp=2 engine starts (~10 s each on 2 CPUs)
@pytest.mark.parametrize("backend", ["multiproc", "ray"])
def test_rank_death_fails_requests_restarts_then_exits(backend: str, request: pytest.FixtureRequest,
                                                       tiny_root: Path, tmp_path: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    args = ["--model", model, "--max-num-seqs", "4", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", backend, "--engine-restarts", "1"]
    if backend == "ray":
        args += ["--set", f"plugins.ray.address={request.getfixturevalue('ray_address')}"]
    with live_server(args, str(tmp_path / "server.log")) as srv:
        first_core = srv.engine_core_pid()
        ranks = _rank_processes(srv, backend)
        assert len(ranks) == 1, ranks

        # Under load: clean 503s at once, then unhealthy (or already restarted: the backoff is 1 s).
        _assert_rank_death_503s(asyncio.run(_kill_rank_under_load(srv, ranks[0])))
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "pagedllm:num_requests_running") == 0

        # Restarted: a new core with a new rank 1 serves again.
        _wait_healthy(srv, within_s=RESTART_S)
        assert srv.engine_core_pid() != first_core
        r = httpx.post(f"{srv.url}/v1/completions", json={**BODY, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text + srv.log()
        assert metric(httpx.get(f"{srv.url}/metrics", timeout=10).text, "pagedllm:engine_core_restarts_total") == 1

        # At rest: the new rank 1 dies with nothing in flight; /health says so without a request's help.
        deadline = time.monotonic() + 10  # the killed one may linger a moment in the process table
        while len(new_ranks := [p for p in _rank_processes(srv, backend) if p.pid != ranks[0].pid]) != 1:
            assert time.monotonic() < deadline, [(p.pid, p.cmdline()) for p in new_ranks]
            time.sleep(0.2)
        new_ranks[0].kill()
        _unhealthy_after(srv, DETECT_AT_REST_S)
        # The one restart is spent: the process ends with status 1, within seconds.
        assert srv.proc.wait(60) == 1, srv.log()
        log = Path(srv.log_path).read_text()
        assert "no restart is left" in log and "tensor-parallel rank 1 (" in log, log
        assert "Traceback" not in log, log
