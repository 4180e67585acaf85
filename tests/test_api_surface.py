"""docs/plugins/api.md lists exactly the names pagedllm.api exports, each resolves, and the top module (and
pagedllm.api.cli) is light."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins" / "api.md"
MODULES = ["pagedllm.api"] + [
    f"pagedllm.api.{m}"
    for m in ("attention", "kv", "sched", "model", "quantization", "loading", "kernels", "engine", "executor",
              "spec_decode", "cli", "parsers", "structured_output")
]


def _documented() -> dict[str, set[str]]:
    sections: dict[str, set[str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^### `([\w.]+)`", line)
        if heading:
            current = heading.group(1)
            sections[current] = set()
        elif current and line.startswith("`"):
            sections[current] |= set(re.findall(r"`(\w+)`", line))
    return sections


@pytest.mark.parametrize("name", MODULES)
def test_each_module_is_documented_name_for_name(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert _documented().get(name) == exported
    for attr in exported:
        assert getattr(module, attr) is not None


def test_every_api_module_is_listed() -> None:
    package = Path(importlib.import_module("pagedllm.api").__file__ or "").parent
    on_disk = {"pagedllm.api"} | {f"pagedllm.api.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    assert on_disk == set(MODULES) == set(_documented())


def test_the_top_module_does_not_import_torch() -> None:
    code = "import sys, pagedllm.api; assert 'torch' not in sys.modules, 'pagedllm.api imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cli_module_does_not_import_torch() -> None:
    # Command plugins declare their flags with it while `pagedllm --help` builds the parser.
    code = "import sys, pagedllm.api.cli; assert 'torch' not in sys.modules, 'pagedllm.api.cli imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
