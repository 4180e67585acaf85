"""SIGTERM drains: an in-flight stream finishes, then the server and its engine-core process exit cleanly."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")

from test_server_support import live_server  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


def test_sigterm_drains_in_flight_stream_then_exits(tiny_root: Path, tmp_path: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    with live_server(["--model", model, "--served-model-name", "tiny"], str(tmp_path / "server.log")) as srv:
        core = psutil.Process(srv.engine_core_pid())
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    srv.proc.send_signal(signal.SIGTERM)  # mid-stream
                events.append(line[6:])
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length" and len(finish) == 300  # every token arrived
        assert srv.proc.wait(30) == 0
        core.wait(30)  # the engine core was shut down with the server
