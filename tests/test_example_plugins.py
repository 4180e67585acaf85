"""The example package, examples/pagedllm-example-plugins, installed by pip and used through a config file.

pip builds and installs it (offline: no index, no build isolation, no dependencies) into a temporary
`--target` folder put on sys.path — the shared virtual environment is never touched, and "uninstalling" is
taking the folder off sys.path again. Each engine gets its own PluginManager, so discovery really runs
against what is installed at that moment.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tiny_models import make_tiny_model

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.selector import SelectionError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "examples" / "pagedllm-example-plugins"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pip-install the example package into a fresh folder on sys.path; remove it again afterwards."""
    target = tmp_path_factory.mktemp("example_site")
    build = tmp_path_factory.mktemp("example_build")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    import shutil

    src = build / "pkg"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    sys.path.insert(0, str(target))
    try:
        yield target
    finally:
        _uninstall(target)


def _uninstall(target: Path) -> None:
    if str(target) in sys.path:
        sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.split(".")[0] == "pagedllm_example_plugins"]:
        del sys.modules[name]
    import importlib

    importlib.invalidate_caches()


def _config(tmp_path: Path, tiny_root: Path, **sections: object) -> Path:
    data = {"model": make_tiny_model("llama", tiny_root), "num_threads": 1,
            "kv_cache": {"num_blocks": 64, "block_size": 4}, **sections}
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> tuple[list[str], dict[str, list[int]]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    finished: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return finished, tokens


PROMPTS = {"long": list(range(10, 22)), "short": [30, 31, 32], "medium": list(range(40, 47))}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_installed_package_is_discovered_with_its_distribution(installed: Path) -> None:
    pm = PluginManager()
    pm.discover()
    for kind, name in [(PluginKind.SCHEDULER, "spf"), (PluginKind.ATTENTION, "stats_torch"),
                       (PluginKind.LOGITS_PROCESSOR, "ban_tokens")]:
        spec = pm.get(kind, name)
        assert spec is not None, (kind, name, pm.records)
        assert (spec.distribution, spec.version) == ("pagedllm-example-plugins", "0.1.0")
    assert not pm.broken()


def test_config_file_selects_the_example_components_and_they_run(
    installed: Path, tmp_path: Path, tiny_root: Path
) -> None:
    pm = PluginManager()
    baseline = LLMEngine(EngineConfig.from_file(_config(tmp_path, tiny_root, scheduler={"max_num_seqs": 1})), pm)
    fcfs_order, plain = _run(baseline, PROMPTS, GREEDY)
    assert fcfs_order == ["long", "short", "medium"]  # fcfs: arrival order, one at a time
    banned = sorted({t for ids in plain.values() for t in ids})

    path = _config(tmp_path, tiny_root, scheduler={"name": "spf", "max_num_seqs": 1},
                   attention={"backend": "stats_torch"}, logits_processors=["ban_tokens"],
                   plugins={"ban_tokens": {"token_ids": banned}})
    engine = LLMEngine(EngineConfig.from_file(path), pm)
    selections = engine.parts.selections
    assert selections["scheduler"].winner.distribution == "pagedllm-example-plugins"
    assert selections["attention"].winner.name == "stats_torch"
    assert selections["logits_processor[ban_tokens]"].winner.distribution == "pagedllm-example-plugins"
    backend = selections["attention"].load()
    backend.reset()

    order, tokens = _run(engine, PROMPTS, GREEDY)
    # The scheduler: shortest prompt first.
    assert order == ["short", "medium", "long"]
    assert engine.core.scheduler.admission_order == ["short", "medium", "long"]
    # The backend: one record per model step, with the step's tokens and requests.
    assert backend.tokens_per_step and sum(backend.tokens_per_step) == sum(len(p) + 3 for p in PROMPTS.values())
    assert set(backend.requests_per_step) == {1}
    # The logits processor: no token the unconstrained run produced is ever sampled.
    assert all(len(ids) == 4 and not set(ids) & set(banned) for ids in tokens.values()), (tokens, banned)


def test_per_request_ban_through_extra_args(installed: Path, tmp_path: Path, tiny_root: Path) -> None:
    pm = PluginManager()
    engine = LLMEngine(EngineConfig.from_file(_config(tmp_path, tiny_root, logits_processors=["ban_tokens"])), pm)
    _, plain = _run(engine, {"a": [5, 6, 7]}, GREEDY)
    params = GREEDY.clone()
    params.extra_args = {"ban_token_ids": plain["a"]}  # type: ignore[attr-defined]
    _, both = _run(engine, {"b": [5, 6, 7], "c": [5, 6, 7]}, GREEDY)
    _, banned = _run(engine, {"d": [5, 6, 7]}, params)
    assert both["b"] == both["c"] == plain["a"]  # no ban configured or asked: unchanged
    assert not set(banned["d"]) & set(plain["a"])


def test_bad_plugin_section_names_the_key(installed: Path, tmp_path: Path, tiny_root: Path) -> None:
    path = _config(tmp_path, tiny_root, logits_processors=["ban_tokens"],
                   plugins={"ban_tokens": {"token_ids": "seven", "colour": 1}})
    with pytest.raises(Exception) as info:
        LLMEngine(EngineConfig.from_file(path), PluginManager())
    message = str(info.value)
    assert "plugins.ban_tokens.token_ids" in message and "plugins.ban_tokens.colour: unknown key" in message


def test_after_uninstalling_the_engine_falls_back_cleanly(installed: Path, tmp_path: Path, tiny_root: Path) -> None:
    _uninstall(installed)
    try:
        # Asked for by name: a clear error saying it is not installed.
        pm = PluginManager()
        path = _config(tmp_path, tiny_root, scheduler={"name": "spf"})
        with pytest.raises(SelectionError, match=r"no scheduler named 'spf'; available: fcfs; no installed plugin"):
            LLMEngine(EngineConfig.from_file(path), pm)
        path = _config(tmp_path, tiny_root, logits_processors=["ban_tokens"])
        with pytest.raises(SelectionError, match=r"no logits_processor named 'ban_tokens'"):
            LLMEngine(EngineConfig.from_file(path), pm)
        # Not asked for: the defaults, chosen as if the package had never been installed.
        engine = LLMEngine(EngineConfig.from_file(_config(tmp_path, tiny_root)), pm)
        assert engine.parts.selections["scheduler"].winner.name == "fcfs"
        assert engine.parts.selections["attention"].winner.name == "torch"
        assert not engine.core.logits_processors
        order, _ = _run(engine, PROMPTS, GREEDY)
        assert sorted(order) == sorted(PROMPTS)
    finally:
        sys.path.insert(0, str(installed))
