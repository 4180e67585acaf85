"""`pagedllm plugin new KIND NAME [DIR]`: the package it writes installs, is discovered, is selected from a
config file, generates the in-tree default's greedy tokens, and passes its own tests.

Packages are installed as tests/test_example_plugins.py installs its example: pip builds them offline (no
index, no build isolation, no dependencies) into a temporary `--target` folder, which the subprocesses get
on PYTHONPATH. The shared virtual environment is never touched, so "uninstalling" is dropping the folder.

Every kind's package is generated and installed once for the module (one pip call), listed by one
`pagedllm plugins --json`, and the packages' own tests run in one pytest process; each kind's case then
runs its engine with the allow-list (`PAGEDLLM_PLUGINS`) naming its distribution alone, so no other
starter package takes part. A subprocess per kind and stage cost ~15 s a kind (most of the file's time).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import yaml
from tiny_models import make_tiny_model

from pagedllm.cli import plugin_cmd
from pagedllm.cli.main import main

FAST_KINDS = ("scheduler", "attention", "executor")
KIND_CASES = [
    pytest.param(kind, marks=() if kind in FAST_KINDS else (pytest.mark.slow,)) for kind in plugin_cmd.STARTERS
]
# Two share a 12-token prefix: with max_num_seqs 1 the second finds three cached KV blocks of 4.
PROMPTS = [list(range(10, 22)), [*range(10, 22), 40, 41, 42], [30, 31, 32]]
# What a YAML config must say to select each kind's component ({} = installing it selects it). The model
# kind instead points the config at a checkpoint naming its architecture.
SELECT: dict[str, dict[str, Any]] = {
    "scheduler": {"scheduler": {"name": "{name}"}},
    "attention": {"attention": {"backend": "{name}"}},
    "kv_manager": {},
    "loader": {"loader": {"name": "{name}"}},
    "quantization": {"quantization": {"method": "{name}"}},
    "model": {},
    "logits_processor": {"logits_processors": ["{name}"]},
    "proposer": {"speculative": {"method": "{name}", "num_speculative_tokens": 2}},
    "executor": {"parallel": {"executor": "{name}"}},
    "command": {},  # not engine parts: the command, and `pagedllm serve --entrypoint`, run the config instead
    "entrypoint": {},
    "tool_parser": {},  # not engine parts either: `pagedllm serve --tool-call-parser NAME` picks them
    "reasoning_parser": {},
    "structured_output": {"structured_outputs": {"backend": "{name}"}},
    "kv_connector": {"kv_transfer": {"kv_connector": "{name}"}},
}
SELECTION_KEY = {"scheduler": "scheduler", "attention": "attention", "kv_manager": "kv_manager",
                 "loader": "loader", "quantization": "quantization", "model": "model",
                 "logits_processor": "logits_processor[{name}]", "proposer": "proposer", "executor": "executor",
                 "kv_connector": "kv_connector"}
# Run in a subprocess: the config file's greedy tokens and every selection's winner.
_DRIVER = """
import json, sys
from pagedllm import LLM, SamplingParams
llm = LLM(config=sys.argv[1])
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], params, use_tqdm=False)
selections = {k: [s.winner.name, s.winner.distribution] for k, s in llm.engine.parts.selections.items()}
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "selections": selections}))
"""


def _env(site: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDLLM_PLUGINS")}
    env.update(HF_HUB_OFFLINE="1", **extra)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd[:4])} ... failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def _drive(config: Path, env: dict[str, str]) -> dict[str, Any]:
    out = _run([sys.executable, "-c", _DRIVER, str(config), json.dumps(PROMPTS)], env)
    return dict(json.loads(out.stdout.splitlines()[-1]))


@dataclass
class Package:
    kind: str
    name: str
    root: Path  # the generated sources
    site: Path  # where pip installed them
    component: str
    dist: str


def _generate(kind: str, name: str, root: Path) -> None:
    assert main(["plugin", "new", kind, name, str(root)]) == 0


def _install(roots: list[Path], site: Path) -> None:
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "--quiet", "--target", str(site), *map(str, roots)], _env())


@pytest.fixture(scope="module")
def starters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Package]:
    """Every kind's package, generated and installed into one site folder."""
    base = tmp_path_factory.mktemp("starters")
    site = base / "site"
    packages: dict[str, Package] = {}
    for kind in plugin_cmd.STARTERS:
        name = f"my_{kind}"
        _generate(kind, name, base / kind)
        component = name if kind != "model" else "".join(p.capitalize() for p in name.split("_")) + "ForCausalLM"
        packages[kind] = Package(kind, name, base / kind, site, component, f"pagedllm-{name.replace('_', '-')}")
    _install([p.root for p in packages.values()], site)
    return packages


@pytest.fixture(scope="module")
def listing(starters: dict[str, Package]) -> dict[str, Any]:
    """`pagedllm plugins --json` with every starter package installed."""
    site = next(iter(starters.values())).site
    return dict(json.loads(_run([sys.executable, "-m", "pagedllm.cli.main", "plugins", "--json"], _env(site)).stdout))


@pytest.fixture(scope="module")
def own_tests(starters: dict[str, Package], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Counter[str]]:
    """Each package's own test file -> its outcomes ("passed", "failed", "skipped", ...), from one pytest run."""
    site = next(iter(starters.values())).site
    report = tmp_path_factory.mktemp("own") / "junit.xml"
    # importlib mode: every package's tests folder holds a conftest.py, and none is a Python package.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                    f"--junitxml={report}", *(str(p.root / "tests") for p in starters.values())],
                   env=_env(site), capture_output=True, text=True, timeout=900)
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        verdict = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes[case.get("classname", "").rsplit(".", 1)[-1]][verdict] += 1
    return outcomes


@pytest.fixture(scope="module")
def tiny_model(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.fixture(scope="module")
def baseline(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The default engine's greedy tokens, every third-party plugin blocked: the in-tree defaults."""
    config = tmp_path_factory.mktemp("baseline") / "engine.yaml"
    config.write_text(yaml.safe_dump(_engine(tiny_model)))
    result = _drive(config, _env(PAGEDLLM_PLUGINS=""))
    assert {"scheduler": "fcfs", "attention": "torch", "loader": "hf", "quantization": "none"}.items() <= {
        k: v[0] for k, v in result["selections"].items()}.items()
    return list(result["tokens"])


def _engine(model: str, **sections: Any) -> dict[str, Any]:
    return {"model": model, "num_threads": 1, "kv_cache": {"num_blocks": 64, "block_size": 4},
            "scheduler": {"max_num_seqs": 1}, **sections}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _checkpoint_for(package: Package, tiny_model: str, tmp_path: Path) -> str:
    """The model kind's checkpoint: the tiny Llama's weights, config.json naming the new architecture."""
    import shutil

    ours = tmp_path / "checkpoint"
    shutil.copytree(tiny_model, ours)
    config = json.loads((ours / "config.json").read_text())
    config["architectures"] = [package.component]
    (ours / "config.json").write_text(json.dumps(config))
    return str(ours)


# -- generate, install, discover, select, run, self-test ----------------------------------------------------


@pytest.mark.parametrize("kind", KIND_CASES)
def test_the_generated_package_installs_is_selected_and_passes_its_tests(
    kind: str, tmp_path: Path, tiny_model: str, baseline: list[list[int]], starters: dict[str, Package],
    listing: dict[str, Any], own_tests: dict[str, Counter[str]],
) -> None:
    package = starters[kind]
    name, root, component = package.name, package.root, package.component
    env = _env(package.site, PAGEDLLM_PLUGINS=package.dist)

    # 1. Discovered, with its distribution, by `pagedllm plugins --json`.
    mine = [c for c in listing["components"] if c["name"] == component]
    assert [(c["kind"], c["distribution"], c["version"]) for c in mine] == [
        (plugin_cmd.STARTERS[kind].kind.value, package.dist, "0.1.0")], mine
    assert [p["status"] for p in listing["plugins"] if p["distribution"] == package.dist] == ["loaded"]

    # 2. Selected from a YAML file (the generated engine.yaml's selection, where the kind has a config key),
    #    it generates the in-tree default's greedy tokens.
    select = json.loads(json.dumps(SELECT[kind]).replace("{name}", name))
    if (root / "engine.yaml").exists():
        assert yaml.safe_load((root / "engine.yaml").read_text()).items() >= select.items()
    model = _checkpoint_for(package, tiny_model, tmp_path) if kind == "model" else tiny_model
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(_merge(_engine(model), select)))
    if kind == "command":  # not an engine part: `pagedllm my_command --config engine.yaml` prints greedy tokens
        out = _run([sys.executable, "-m", "pagedllm.cli.main", name, "--config", str(config),
                    "--token-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", "6"], env)
        assert json.loads(out.stdout.splitlines()[-1])["token_ids"] == baseline[0]
    elif kind == "entrypoint":  # `pagedllm serve --entrypoint my_entrypoint --config engine.yaml` < JSON lines
        lines = "".join(json.dumps({"prompt_token_ids": p, "max_tokens": 6, "ignore_eos": True}) + "\n" for p in PROMPTS)
        served = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "serve", "--entrypoint", name,
                                 "--config", str(config)], input=lines, env=env, capture_output=True, text=True,
                                timeout=300)
        assert served.returncode == 0, served.stderr
        assert [json.loads(line)["token_ids"] for line in served.stdout.splitlines()] == baseline
    elif kind in ("tool_parser", "reasoning_parser"):  # the server's, by name: parse through the registry
        probe = ("import sys\nfrom pagedllm.api import PluginKind\nfrom pagedllm.api.engine import get_plugin_manager\n"
                 f"spec = get_plugin_manager().get(PluginKind.{kind.upper()}, {name!r})\n"
                 "print(spec.resolve().__module__, spec.distribution)")
        assert _run([sys.executable, "-c", probe], env).stdout.split() == [f"{package.dist.replace('-', '_')}.parser",
                                                                           package.dist]
    elif kind == "structured_output":  # chosen per request: the engine's greedy tokens are unchanged by it
        probe = ("from pagedllm.api import PluginKind\nfrom pagedllm.api.engine import get_plugin_manager\n"
                 f"spec = get_plugin_manager().get(PluginKind.STRUCTURED_OUTPUT, {name!r})\n"
                 "print(spec.resolve().__module__, spec.distribution)")
        assert _run([sys.executable, "-c", probe], env).stdout.split() == [
            f"{package.dist.replace('-', '_')}.backend", package.dist]
        assert _drive(config, env)["tokens"] == baseline
    else:
        _check_selected_and_greedy(package, config, env, baseline)

    # 3. Its own tests pass, every one of them (none skipped).
    count = len(re.findall(r"^def test_", (root / "tests" / f"test_{name}.py").read_text(), re.MULTILINE))
    assert own_tests[f"test_{name}"] == Counter(passed=count), own_tests[f"test_{name}"]


def _check_selected_and_greedy(package: Package, config: Path, env: dict[str, str], baseline: list[list[int]]) -> None:
    name, component = package.name, package.component
    result = _drive(config, env)
    key = SELECTION_KEY[package.kind].format(name=name)
    assert result["selections"][key] == [component, package.dist], result["selections"]
    assert result["tokens"] == baseline


def test_the_generated_test_fails_when_the_policy_breaks(tmp_path: Path) -> None:
    """The scheduler's own test is not vacuous: made last-come-first-served, its order check fails."""
    root, site = tmp_path / "src", tmp_path / "site"
    _generate("scheduler", "lifo", root)
    policy = root / "src" / "pagedllm_lifo" / "scheduler.py"
    text = policy.read_text()
    for fcfs, lifo in (("req = self.waiting[0]", "req = self.waiting[-1]"), ("self.waiting.popleft()", "self.waiting.pop()")):
        assert fcfs in text
        text = text.replace(fcfs, lifo)
    policy.write_text(text)
    _install([root], site)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k", "first_come_first_served"],
        env=_env(site), cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED tests/test_lifo.py::test_first_come_first_served" in result.stdout, result.stdout
    assert "['medium', 'short', 'long']" in result.stdout  # last come, first served


# -- what it writes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(plugin_cmd.STARTERS))
def test_every_kind_renders_a_complete_light_lint_clean_package(kind: str, tmp_path: Path) -> None:
    name = f"my_{kind}"
    _generate(kind, name, tmp_path / "pkg")
    root = tmp_path / "pkg"
    files = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}
    package = f"pagedllm_{name}"
    module = plugin_cmd.STARTERS[kind].module
    assert {"pyproject.toml", "README.md", f"src/{package}/__init__.py", f"src/{package}/{module}.py",
            "tests/conftest.py", f"tests/test_{name}.py"} <= set(files)
    assert not [rel for rel, text in files.items() if plugin_cmd._PLACEHOLDER.search(text)]

    project = tomllib.loads(files["pyproject.toml"])
    group = plugin_cmd.STARTERS[kind].kind.entry_point_group
    assert project["project"]["entry-points"] == {group: {name: package}}
    assert project["project"]["dependencies"] == ["pagedllm"]

    # The registration module declares the plugin API it supports and is light: at module level it imports
    # pagedllm.api and nothing heavy; its own implementation only inside the load function.
    tree = ast.parse(files[f"src/{package}/__init__.py"])
    declared = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    # Commands need 1.2, KV connectors 1.4 (when their kinds arrived); every other kind any 1.x.
    assert declared["PAGEDLLM_PLUGIN_API"] == {"command": ">=1.2,<2", "kv_connector": ">=1.4,<2"}.get(kind, ">=1,<2")
    module_level = _imported(tree.body)
    assert module_level <= {"__future__", "typing", "os", "pydantic", "pagedllm.api"}, module_level
    assert _imported(ast.walk(tree)) - module_level == {f"{package}.{module}"}
    # The implementation reaches pagedllm only through its public API (a plugin never imports another).
    impl = _imported(ast.walk(ast.parse(files[f"src/{package}/{module}.py"])))
    assert {m for m in impl if m.startswith("pagedllm")} <= {package} | {m for m in impl if m.startswith("pagedllm.api")}

    # Lint-clean under the rules this repository uses (so a user's ruff starts green).
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E,F,I,UP,B,SIM,W",
                           "--line-length", "110", "--output-format", "concise", "."],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _imported(nodes: Any) -> set[str]:
    """The modules `nodes` import (absolute imports only; the templates use no relative ones)."""
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_registration_imports_nothing_heavy(tmp_path: Path) -> None:
    """Discovery imports every registration module: none may pull in torch."""
    sites = []
    for kind in plugin_cmd.STARTERS:
        root = tmp_path / kind
        _generate(kind, f"my_{kind}", root)
        sites.append(str(root / "src"))
    code = ("import importlib, sys\n"
            + "".join(f"importlib.import_module('pagedllm_my_{k}')\n" for k in plugin_cmd.STARTERS)
            + "importlib.import_module('pagedllm_my_command.cli')\n"  # a command's flags: `pagedllm --help` builds them
            + "print('torch' in sys.modules)")
    out = _run([sys.executable, "-c", code], _env(PYTHONPATH=os.pathsep.join(sites)))
    assert out.stdout.strip() == "False"


# -- what it refuses -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sampler", "attention_kernel"])
def test_a_kind_it_cannot_write_exits_2_listing_the_supported_ones(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugin", "new", kind, "x", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedllm: error: ") and kind in err
    assert ("supported kinds: scheduler, attention, kv_manager, loader, quantization, model, logits_processor, "
            "proposer, executor, command, entrypoint, tool_parser, reasoning_parser, kv_connector, structured_output") in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["Spf", "1st", "my-sched", "class", "a" * 41, "", "spf!"])
def test_a_bad_name_is_refused_saying_what_a_name_may_be(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugin", "new", "scheduler", name, str(tmp_path / "x")]) == 2
    assert f"invalid plugin name '{name}': use 1-40 lower-case letters, digits and underscores" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_name_another_distribution_registers_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugin", "new", "scheduler", "fcfs", str(tmp_path / "x")]) == 2
    assert "scheduler 'fcfs' is already registered by pagedllm; pick another name" in capsys.readouterr().err
    # Another kind may use the name: components are per kind.
    assert main(["plugin", "new", "attention", "fcfs", str(tmp_path / "y")]) == 0


def test_a_non_empty_folder_is_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["plugin", "new", "scheduler", "spf", str(tmp_path / "busy")]) == 2
    assert "is not an empty folder; refusing to overwrite it" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    assert main(["plugin", "new", "scheduler", "spf", str(tmp_path / "empty")]) == 0


def test_dir_defaults_to_pagedllm_name_in_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plugin", "new", "scheduler", "my_spf"]) == 0
    assert (tmp_path / "pagedllm-my-spf" / "src" / "pagedllm_my_spf" / "scheduler.py").is_file()
    out = capsys.readouterr().out
    assert "pip install -e pagedllm-my-spf" in out and "pytest pagedllm-my-spf/tests" in out


def test_a_template_placeholder_without_a_value_is_an_error() -> None:
    assert plugin_cmd.fill("{{name}} {x} {{ name }}", {"name": "spf"}) == "spf {x} {{ name }}"
    with pytest.raises(KeyError, match="nmae"):
        plugin_cmd.fill("{{nmae}}", {"name": "spf"})
