"""Issue 26: with an API key set, every route needs it -- routes a plugin adds through `server_app_created`
too (before: only /v1, /tokenize and /detokenize were covered) -- except the explicit open list (/health,
/metrics); while draining, every route but /metrics answers 503 with Retry-After.

In-process (starlette's TestClient over the real `build_app`); the engine is a stand-in with the attributes
the routes read, since no route here generates.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from pagedllm.api import hookimpl  # noqa: E402
from pagedllm.api.engine import EngineDeadError  # noqa: E402
from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.plugin_manager import PluginManager  # noqa: E402
from pagedllm.plugins.server.app import OPEN_PATHS, build_app  # noqa: E402
from pagedllm.plugins.server.lifecycle import ServerState  # noqa: E402
from pagedllm.sched.stats import SchedulerStats  # noqa: E402

KEY = "sk-reliab"


class _StandInEngine:
    model_name = "stand-in"
    max_model_len = 64
    healthy = True
    dead_reason = None
    restarts = 0

    def __init__(self, pm: PluginManager) -> None:
        self.pm = pm
        self.stats = SchedulerStats()
        self.config = EngineConfig()
        self.finished_listeners: list[Any] = []
        self.iteration_listeners: list[Any] = []

    @property
    def ready(self) -> Any:
        raise EngineDeadError("the engine core has not started")  # as AsyncLLM's before start()


class _RoutePlugin:
    @hookimpl
    def server_app_created(self, app: Any, engine: Any) -> None:
        @app.get("/plugin/status")
        async def status() -> dict[str, str]:
            return {"secret": "plugin data"}


@pytest.fixture
def app_and_state() -> tuple[Any, ServerState]:
    pm = PluginManager()
    pm.register(_RoutePlugin(), name="route-plugin")
    state = ServerState()
    return build_app(_StandInEngine(pm), api_key=KEY, state=state), state  # type: ignore[arg-type]


def test_key_covers_plugin_routes_and_unknown_paths(app_and_state: tuple[Any, ServerState]) -> None:
    client = TestClient(app_and_state[0])
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/plugin/status", "/v1/models", "/openapi.json", "/docs", "/no/such/route"):
        r = client.get(path)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/plugin/status", headers=auth).json() == {"secret": "plugin data"}
    assert client.get("/no/such/route", headers=auth).status_code == 404
    # Probes and scrapers only: health (and vLLM's /ping spelling of it), the version, the metrics.
    assert {"/health", "/ping", "/version", "/metrics"} == OPEN_PATHS
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_draining_refuses_all_but_metrics(app_and_state: tuple[Any, ServerState]) -> None:
    app, state = app_and_state
    client = TestClient(app)
    state.draining = True
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/plugin/status", "/v1/models"):
        r = client.get(path, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert r.headers["retry-after"] == "5"
    health = client.get("/health")
    assert health.status_code == 503 and health.headers["retry-after"]
    assert client.get("/metrics").status_code == 200


def test_chunked_body_over_the_limit_is_413_not_400() -> None:
    pm = PluginManager()
    app = build_app(_StandInEngine(pm), max_body_bytes=1000)  # type: ignore[arg-type]

    def chunks() -> Any:
        for _ in range(5):
            yield b'{"prompt": "' + b"x" * 400

    r = TestClient(app).post("/tokenize", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
