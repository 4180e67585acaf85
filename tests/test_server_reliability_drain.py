"""Issue 26, graceful drain: SIGTERM stops admission (503 + Retry-After) while in-flight requests run on; past
--drain-timeout the rest end with an OpenAI-shaped 503 (a stream: an error event, then [DONE]), and the
server exits 0 with its engine core, no traceback in the log and no ipc socket left behind.

Before: non-streaming clients got a plain-text `500 Internal Server Error`, streams were cut without an
error event or [DONE], and the log held `ZMQError: Socket operation on non-socket` tracebacks.
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

from test_server_support import LiveServer, live_server  # noqa: E402
from tiny_models import tiny_config  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
DRAIN_TIMEOUT_S = 1.5


def make_slow_model(root: Path) -> str:
    """A random Llama big enough that a decode step costs milliseconds on the CPU (the tiny test models run
    500 tokens in under a second): long requests then reliably outlive a short drain timeout."""
    import torch
    import transformers

    path = root / "llama_slow"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.update(dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, max_position_embeddings=1024))
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def _ipc_paths(pid: int) -> set[str]:
    """The unix sockets the server bound (its engine-core channel, in a private folder under the temp dir)."""
    return {c.laddr for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr}


async def _drain_scenario(srv: LiveServer) -> dict[str, Any]:
    """A short stream that finishes inside the drain, long ones (a stream and a plain request) that do not;
    SIGTERM once they run; a new request during the drain."""
    started = asyncio.Event()
    long_body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0}

    async def stream(http: httpx.AsyncClient, max_tokens: int) -> list[str]:
        events = []
        body = {**long_body, "max_tokens": max_tokens, "stream": True}
        async with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    started.set()
                    events.append(line[6:])
        return events

    async def plain(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(f"{srv.url}/v1/completions", json={**long_body, "n": 2})

    async with httpx.AsyncClient(timeout=60) as http:
        long_stream = asyncio.create_task(stream(http, 900))
        long_plain = asyncio.create_task(plain(http))
        await asyncio.wait_for(started.wait(), timeout=60)
        short_stream = asyncio.create_task(stream(http, 20))
        await asyncio.sleep(0.2)
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=10) as fresh:  # a new connection during the drain
            during = await fresh.post(f"{srv.url}/v1/completions", json={**long_body, "max_tokens": 2})
            health = await fresh.get(f"{srv.url}/health")
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(long_stream, long_plain, short_stream), timeout=30)
        return {"during": during, "health": health, "long_stream": results[0], "long_plain": results[1],
                "short_stream": results[2], "ended_after_s": time.monotonic() - t0}


def test_sigterm_drains_then_ends_the_rest_cleanly(tiny_root: Path, tmp_path: Path) -> None:
    model = make_slow_model(tiny_root)
    args = ["--model", model, "--max-num-seqs", "4", "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    with live_server(args, str(tmp_path / "server.log")) as srv:
        core = psutil.Process(srv.engine_core_pid())
        sockets = _ipc_paths(srv.proc.pid)
        assert sockets, "the server has no ipc socket to check"
        out = asyncio.run(_drain_scenario(srv))

        during = out["during"]
        assert during.status_code == 503 and during.json()["error"]["code"] == "server_shutting_down"
        assert during.headers["retry-after"]
        assert out["health"].status_code == 503

        short = out["short_stream"]  # finished inside the drain: every token, then [DONE]
        assert short[-1] == "[DONE]"
        assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"

        long_stream = out["long_stream"]
        assert long_stream[-1] == "[DONE]"
        assert json.loads(long_stream[-2])["error"]["code"] == "server_shutting_down"
        plain = out["long_plain"]
        assert plain.status_code == 503 and plain.headers["content-type"] == "application/json", plain.text
        assert plain.json()["error"]["code"] == "server_shutting_down"

        assert srv.proc.wait(30) == 0
        core.wait(30)
    log = Path(tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "ZMQError" not in log, log[-3000:]
    left = [p for p in sockets if os.path.exists(p) or os.path.exists(os.path.dirname(p))]
    assert not left, f"ipc sockets left behind: {left}"
