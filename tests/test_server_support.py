"""Helpers for the server tests: start `pagedllm serve` on loopback in a subprocess, wait, stop. No tests here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

HOST = "127.0.0.1"
START_TIMEOUT_S = float(os.environ.get("PAGEDLLM_TEST_SERVER_START_S", "600"))


@dataclass
class LiveServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def engine_core_pid(self) -> int:
        """The spawned engine-core child (not multiprocessing's resource tracker, nor a tensor-parallel rank:
        those are spawned by the core, one level further down)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children():
            if any("spawn_main" in part for part in child.cmdline()):
                return child.pid
        raise AssertionError("no engine-core child process found")

    def tp_ranks(self) -> list[Any]:
        """The engine core's tensor-parallel rank processes (`multiproc`: spawned children of the core), as
        psutil.Process objects."""
        import psutil

        core = psutil.Process(self.engine_core_pid())
        return [p for p in core.children() if any("spawn_main" in part for part in p.cmdline())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(args: list[str], log_path: str, headers: dict[str, str] | None = None) -> Iterator[LiveServer]:
    """`python -m pagedllm.cli.serve_cmd ARGS --host 127.0.0.1 --port P`, yielded once /health answers 200."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "pagedllm.cli.serve_cmd", *args, "--host", HOST, "--port", str(port),
           "--log-level", os.environ.get("PAGEDLLM_TEST_SERVER_LOG_LEVEL", "warning"), "--num-threads", "1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = LiveServer(proc, f"http://{HOST}:{port}", log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not healthy after {START_TIMEOUT_S:.0f}s:\n{server.log()}")
            time.sleep(1)
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM (the server drains, then stops its engine core), SIGKILL to the group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def metric(text: str, name: str) -> float:
    """Sum of every sample of `name` (any labels) in a Prometheus text exposition."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not exposed"
    return total
