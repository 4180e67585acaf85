"""`--no-ui` / `plugins.openai.ui` and the API key's reach over the web UI, on the real app (in-process, an
AsyncLLM that is never started: no route here generates)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")

import pydantic  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from pagedllm.cli import serve_cmd  # noqa: E402
from pagedllm.plugins.server.app import build_app  # noqa: E402
from pagedllm.plugins.server.options import ServerSection  # noqa: E402

KEY = "sk-ui-options"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_no_ui_flag_over_the_config_section() -> None:
    assert _parse().ui is None and _parse("--no-ui").ui is False
    flag = argparse.Namespace
    assert ServerSection.resolve_ui(flag(ui=None), None) is True  # on by default
    assert ServerSection.resolve_ui(flag(ui=None), {"ui": False}) is False  # the config file turns it off
    assert ServerSection.resolve_ui(flag(ui=False), {"ui": True}) is False  # the flag wins
    with pytest.raises(pydantic.ValidationError, match="ui"):
        ServerSection.model_validate({"ui": "sometimes"})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from structured_models import tiny_model_with_tokenizer

    from pagedllm.api.engine import AsyncLLM, EngineConfig
    from pagedllm.engine.serialization import Ready

    model = tiny_model_with_tokenizer(Path(tmp_path_factory.mktemp("models")))
    engine = AsyncLLM(EngineConfig(model=model), served_model_name="tiny")
    # What a started core would have said (the app reads the limits as it is built); no process runs.
    engine._ready = Ready(pid=0, model_name=model, max_model_len=1024, eos_token_ids=[0], vocab_size=49152,
                          num_blocks=64, block_size=16)
    return engine


def test_ui_routes_and_key(engine: Any) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with_ui = TestClient(build_app(engine, api_key=KEY, ui=True))
    page = with_ui.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert with_ui.get("/ui/static/chat.js").headers["content-type"].startswith("text/javascript")
    # The page loads without the key (it asks for it); the data does not.
    for path in ("/ui/events", "/v1/models", "/ui/static/../app.py", "/ui/static/missing.js"):
        response = with_ui.get(path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
    missing = with_ui.get("/ui/static/missing.js", headers=auth)
    assert missing.status_code == 404 and "missing.js" in missing.json()["error"]["message"]

    without_ui = TestClient(build_app(engine, api_key=KEY, ui=False))
    assert without_ui.get("/").status_code == 401  # no open page: "/" is an unknown path like any other
    for path in ("/", "/ui/static/chat.js", "/ui/events"):
        assert without_ui.get(path, headers=auth).status_code == 404, path
    assert without_ui.get("/v1/models", headers=auth).status_code == 200

    open_ui = TestClient(build_app(engine, ui=True))  # no key: everything open
    assert open_ui.get("/").status_code == 200


def test_engine_is_watched_only_while_a_dashboard_is_connected(engine: Any) -> None:
    import asyncio

    from pagedllm.plugins.server.ui.feed import DashboardFeed

    async def scenario() -> list[float]:
        feed = DashboardFeed(engine, draining=lambda: False)
        seen = [engine._watch_interval]
        first, second = feed.events(), feed.events()
        assert (await anext(first)).startswith(b"event: hello\ndata: ")
        seen.append(engine._watch_interval)
        await anext(second)
        await first.aclose()  # one dashboard left, the other still looks
        seen.append(engine._watch_interval)
        await second.aclose()
        seen.append(engine._watch_interval)
        assert feed.clients == 0 and engine.snapshot is None
        return seen

    assert asyncio.run(scenario()) == [0.0, 0.5, 0.5, 0.0]
