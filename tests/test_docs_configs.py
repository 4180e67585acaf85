"""Every config example in docs/ and README.md, and every examples/**/engine.yaml, is a valid EngineConfig."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from pagedllm.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(yaml|toml)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _examples() -> list[tuple[str, str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, match in enumerate(FENCE.finditer(path.read_text())):
            found.append((f"{path.relative_to(ROOT)}#{i}", match.group(1), match.group(2)))
    for path in sorted((ROOT / "examples").rglob("engine.yaml")):
        found.append((str(path.relative_to(ROOT)), "yaml", path.read_text()))
    return found


EXAMPLES = _examples()


def test_there_are_examples() -> None:
    assert any(name.startswith("README.md") for name, _, _ in EXAMPLES)
    assert any(name.startswith("docs/plugins/tutorial.md") for name, _, _ in EXAMPLES)


@pytest.mark.parametrize(("name", "lang", "text"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_config_example_validates(name: str, lang: str, text: str) -> None:
    if lang == "toml" and "[project" in text:
        pytest.skip("a pyproject.toml excerpt, not an engine config")
    data = tomllib.loads(text) if lang == "toml" else yaml.safe_load(text)
    EngineConfig.from_dict(data or {}, source=name, env={})
