"""The plugin contract's import rules (pyproject.toml [tool.importlinter], run by tools/on_installed_layout.py in CI)
cover the whole tree: every core module is in the core lists, every plugin package in the independence list,
and no plugin imports the root package `pagedllm` (import-linter cannot forbid a root without its children)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["importlinter"]["contracts"])


def _core_modules() -> set[str]:
    names = set()
    for entry in (ROOT / "core").iterdir():
        if entry.name.startswith("__") or entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "__init__.py").exists():
            names.add(f"pagedllm.{entry.name}")
        elif entry.suffix == ".py":
            names.add(f"pagedllm.{entry.stem}")
    return names


def _plugin_packages() -> set[str]:
    """Each plugin is a package (or a lone module) inside a kind folder, plus the server package."""
    names = set()
    for kind in (ROOT / "plugins").iterdir():
        if not (kind / "__init__.py").exists():
            continue
        if kind.name == "server":
            names.add("pagedllm.plugins.server")
            continue
        for entry in kind.iterdir():
            if entry.is_dir() and (entry / "__init__.py").exists():
                names.add(f"pagedllm.plugins.{kind.name}.{entry.name}")
            elif entry.suffix == ".py" and entry.name != "__init__.py":
                names.add(f"pagedllm.plugins.{kind.name}.{entry.stem}")
    return names


def test_the_core_lists_name_every_core_module() -> None:
    core_never, plugin_only, _ = _contracts()
    assert set(core_never["source_modules"]) == _core_modules()  # type: ignore[arg-type]
    assert set(plugin_only["forbidden_modules"]) == _core_modules() - {"pagedllm.api"}  # type: ignore[arg-type]


def test_the_independence_list_names_every_plugin() -> None:
    independence = _contracts()[2]
    assert set(independence["modules"]) == _plugin_packages()  # type: ignore[arg-type]


def test_no_plugin_imports_the_root_package() -> None:
    offenders = []
    for path in (ROOT / "plugins").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            from_root = isinstance(node, ast.ImportFrom) and node.module == "pagedllm" and not node.level
            root = isinstance(node, ast.Import) and any(a.name == "pagedllm" for a in node.names)
            if from_root or root:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"import from pagedllm.api instead: {offenders}"


@pytest.mark.slow
def test_lint_imports_fails_on_a_plugin_reaching_into_core(tmp_path: Path) -> None:
    """The contracts can fail: a copy of the tree where a plugin imports a core internal breaks one."""
    import shutil

    tree = tmp_path / "tree"
    for name in ("core", "plugins", "tools"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    scheduler = tree / "plugins" / "schedulers" / "fcfs" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nfrom pagedllm.layers import norm  # noqa\n")
    done = subprocess.run([sys.executable, str(tree / "tools" / "on_installed_layout.py"), "lint-imports", "--no-cache"],
                          cwd=tree, capture_output=True, text=True)
    assert done.returncode != 0
    assert "pagedllm.plugins.schedulers.fcfs.scheduler -> pagedllm.layers.norm" in done.stdout
