"""The wheel holds every module under its `pagedllm` name, and works installed on its own.

`core/` and `plugins/` are mapped under `pagedllm` by `[tool.setuptools.package-dir]`; a package missing from
`[tool.setuptools] packages` is silently dropped from the wheel while the editable install keeps working, so
only these tests notice.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each source folder lands in the installed package.
MAPPED = {"core": "pagedllm", "plugins": "pagedllm/plugins"}


def _pyproject() -> dict:
    import tomllib  # 3.11+, like config.py's TOML support (pyproject still says >=3.10)

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _source_files(suffix: str = ".py") -> dict[str, Path]:
    """Installed path (e.g. pagedllm/plugins/attention/torch_sdpa/__init__.py) -> source file."""
    out = {}
    for folder, target in MAPPED.items():
        for path in sorted((ROOT / folder).rglob(f"*{suffix}")):
            if "__pycache__" not in path.parts:
                out[f"{target}/{path.relative_to(ROOT / folder).as_posix()}"] = path
    return out


def _packages_on_disk() -> set[str]:
    found = {str(Path(name).parent).replace("/", ".") for name in _source_files() if name.endswith("/__init__.py")}
    return found


def test_package_dir_maps_core_and_plugins_under_pagedllm() -> None:
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"pagedllm": "core", "pagedllm.plugins": "plugins"}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = _pyproject()["tool"]["setuptools"]["packages"]
    assert len(listed) == len(set(listed)), "duplicate entries in [tool.setuptools] packages"
    on_disk = _packages_on_disk()
    assert set(listed) == on_disk, (
        f"missing from [tool.setuptools] packages (dropped from the wheel): {sorted(on_disk - set(listed))}; "
        f"listed but not on disk: {sorted(set(listed) - on_disk)}"
    )


def test_every_folder_with_modules_is_a_package() -> None:
    # A folder without __init__.py would be a namespace package, which an explicit `packages` list never ships.
    for folder in MAPPED:
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                assert (path.parent / "__init__.py").exists(), f"{path.parent} has modules but no __init__.py"


def test_entry_points_name_modules_that_exist() -> None:
    files = _source_files()
    for group, eps in _pyproject()["project"]["entry-points"].items():
        for name, value in eps.items():
            module = value.split(":")[0].replace(".", "/")
            assert f"{module}.py" in files or f"{module}/__init__.py" in files, f"{group}:{name} -> {value}"


# -- the built wheel, installed in a fresh venv ------------------------------------------------------------


def _run(cmd: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PAGEDLLM_PLUGINS", "PYTHONPATH")}
    clean.update(HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **env)
    result = subprocess.run(cmd, cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def _can_build_without_isolation() -> bool:
    """Whether this environment's setuptools can build our wheel offline: >= 70.1 has bdist_wheel built in."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (70, 1) or (major >= 69 and importlib.util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from a copy of the tree: the shared checkout gets no build/ or egg-info, and no stale
    build/lib files can leak into the wheel."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "MANIFEST.in"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for folder in MAPPED:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", str(src), "-w", str(out)]
    if _can_build_without_isolation():
        _run([*build, "--no-build-isolation", "--no-index"], cwd=src)
    else:  # an old setuptools here (a fresh 3.11 venv has 65.5 and no `wheel`): pip fetches the declared one
        _run(build, cwd=src)
    (built,) = out.glob("pagedllm-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv that sees this interpreter's packages (torch etc.: nothing is downloaded) and holds the
    wheel's pagedllm.

    --system-site-packages shows the *base* interpreter's site-packages; when the tests themselves run in a
    venv (CI), a .pth adds that venv's site-packages too. Either may hold an editable pagedllm: --ignore-installed
    puts the wheel's copy in the new venv, whose site-packages comes first on sys.path, so it shadows the
    editable one (the tests below check which one is imported).
    """
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], cwd=root.parent)
    if sys.prefix != sys.base_prefix:
        (purelib,) = (root / "lib").glob("python3*/site-packages")
        lines = [f"import site; site.addsitedir({d!r})" for d in site.getsitepackages() if Path(d).is_dir()]
        (purelib / "_outer_venv.pth").write_text("\n".join(lines) + "\n")
    # --without-pip: this interpreter's pip, visible as above, installs into the new venv.
    _run([str(root / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          str(wheel)], cwd=root.parent)
    return root


@pytest.mark.slow
def test_wheel_holds_every_module_at_its_mapped_path(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        ep_text = zf.read(entry_points).decode()
    missing = sorted(set(_source_files()) - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    # Package data too: the web UI's files, which `pagedllm serve` ships at / (tool.setuptools.package-data).
    static = {n for n, p in _source_files("").items() if p.is_file() and "/server/ui/static/" in n}
    assert static and not static - names, f"web UI files missing from the wheel: {sorted(static - names)}"
    dist_info = Path(entry_points).parent.name
    assert {name.split("/")[0] for name in names} == {"pagedllm", dist_info}  # no top-level core/ or plugins/
    for group, eps in _pyproject()["project"]["entry-points"].items():
        assert f"[{group}]" in ep_text
        for name, value in eps.items():
            assert f"{name} = {value}" in ep_text


@pytest.mark.slow
def test_installed_wheel_imports_from_the_venv_not_the_checkout(venv: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.metadata, json, sys, pagedllm, pagedllm.plugins.attention.torch_sdpa as sdpa\n"
        "from pagedllm.plugin_manager import get_plugin_manager\n"
        "get_plugin_manager()\n"
        "files = {m: getattr(mod, '__file__', None) for m, mod in sys.modules.items() if m.startswith('pagedllm')}\n"
        "print(json.dumps({'files': files, 'dist': str(importlib.metadata.distribution('pagedllm')._path)}))"
    )
    result = _run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path)
    data = json.loads(result.stdout)
    venv_root = str(venv.resolve())
    assert data["files"]["pagedllm"].startswith(venv_root), data["files"]["pagedllm"]
    assert data["files"]["pagedllm.plugins.attention.torch_sdpa"].startswith(venv_root)
    outside = {m: f for m, f in data["files"].items() if f and not f.startswith(venv_root)}
    assert not outside, f"imported from outside the venv: {outside}"
    assert data["dist"].startswith(venv_root), data["dist"]


@pytest.mark.slow
def test_installed_pagedllm_plugins_lists_the_in_tree_components(venv: Path, tmp_path: Path) -> None:
    result = _run([str(venv / "bin" / "pagedllm"), "plugins", "--json"], cwd=tmp_path)
    data = json.loads(result.stdout)
    assert {p["status"] for p in data["plugins"]} == {"loaded"}, data["plugins"]
    declared = {(g, n) for g, eps in _pyproject()["project"]["entry-points"].items() for n in eps
                if g != "pytest11"}  # the conformance kit's pytest plugin, not a pagedllm plugin
    assert {(p["group"], p["name"]) for p in data["plugins"] if p["distribution"] == "pagedllm"} == declared
    components = {(c["kind"], c["name"]): c for c in data["components"]}
    for key in [("attention_backend", "torch"), ("scheduler", "fcfs"), ("kv_manager", "full_attention")]:
        assert key in components and components[key]["distribution"] == "pagedllm"
        assert components[key]["available"], components[key]


@pytest.mark.slow
def test_installed_pagedllm_generates_text(venv: Path, tmp_path: Path) -> None:
    cmd = ["generate", "--prompt", "Hi", "--max-tokens", "4", "--num-threads", "2", "--json"]
    result = subprocess.run([str(venv / "bin" / "pagedllm"), *cmd], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        # A packaging fault only if the checkout itself can generate.
        checkout = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", *cmd], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if checkout.returncode != 0:
            pytest.skip(f"the engine does not generate end to end yet, installed or not: {checkout.stderr[-500:]}")
        pytest.fail(f"generate works from the checkout but not from the wheel:\n{result.stderr[-2000:]}")
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["prompt"] == "Hi" and line["error"] is None
    assert line["text"].strip() and 1 <= len(line["token_ids"]) <= 4
