"""pagedllm's pytest plugin (entry point group `pytest11`): fixtures for the conformance kit.

Loaded by every pytest run in an environment where pagedllm is installed, so it must stay light: nothing here
imports torch, transformers or the engine at import time (the fixtures import what they need when used).

Fixtures:

- `pagedllm_device`: the device the kit's checks run on, from `--pagedllm-device` (default "cpu").
- `pagedllm_tiny_model`: a factory, `pagedllm_tiny_model("llama")` -> the folder of a tiny random checkpoint
  (llama, qwen2, qwen3, mistral, gemma2), saved once per session.
- `pagedllm_plugin_manager`: the process-wide plugin manager (what the engine and the checks use by default).
- `pagedllm_component`: registers a component for the test's duration, without a package or entry point:
  `pagedllm_component(PluginKind.SCHEDULER, "mine", lambda: MyScheduler)`; withdrawn when the test ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedllm", "pagedllm conformance kit")
    group.addoption(
        "--pagedllm-device",
        default="cpu",
        help="device for pagedllm's conformance checks (the pagedllm_device fixture), e.g. cuda; default cpu",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pagedllm_conformance: a test that runs a pagedllm.testing check")


def pytest_report_header(config: pytest.Config) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("pagedllm")
    except PackageNotFoundError:
        installed = "not installed"
    return f"pagedllm conformance kit: pagedllm {installed}, device {config.getoption('--pagedllm-device')}"


@pytest.fixture(scope="session")
def pagedllm_device(request: pytest.FixtureRequest) -> str:
    """The device given with --pagedllm-device (default "cpu")."""
    return str(request.config.getoption("--pagedllm-device"))


@pytest.fixture(scope="session")
def pagedllm_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """`make(kind)` -> folder of a tiny random Hugging Face checkpoint of `kind`, saved once per session."""
    root: Path = tmp_path_factory.mktemp("pagedllm_tiny_models")

    def make(kind: str) -> str:
        from pagedllm.testing.tiny import save_tiny_model

        return save_tiny_model(kind, root)

    return make


@pytest.fixture
def pagedllm_plugin_manager() -> Any:
    """The process-wide plugin manager (discovered on first use)."""
    from pagedllm.plugin_manager import get_plugin_manager

    return get_plugin_manager()


@pytest.fixture
def pagedllm_component() -> Iterator[Callable[..., Any]]:
    """`register(kind, name, load, **meta)` -> the ComponentSpec, registered until the test ends."""
    with ExitStack() as stack:

        def register(kind: Any, name: str, load: Callable[[], Any], **meta: Any) -> Any:
            from pagedllm.testing.components import temporary_component

            return stack.enter_context(temporary_component(kind, name, load, **meta))

        yield register
