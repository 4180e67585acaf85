"""Plugin discovery through real package metadata: attribution, broken plugins, the allow-list, load-once.

Third-party plugins are real distributions laid out on disk (`fake_distribution` in conftest.py) and found by
`importlib.metadata` itself; nothing about discovery is mocked.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagedllm import hookimpl, plugin_manager
from pagedllm.cli.main import main
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.plugin_spec import PluginKind, PluginLoadError

ROOT = Path(__file__).resolve().parents[1]

FANCY = """
    from pagedllm import hookimpl


    class FancyScheduler:
        # The names resolve() checks structurally (a real one subclasses pagedllm.sched.base.SchedulerBase).
        add_request = schedule = update_from_output = finish_requests = has_unfinished_requests = None
        get_stats = None


    class FancyAttention:
        pass


    def _needs_hopper(ctx):
        return [] if ctx.compute_capability and ctx.compute_capability >= (9, 0) else ["needs sm90"]


    @hookimpl
    def register_schedulers(register):
        register("fancy", lambda: FancyScheduler, priority=5, description="a third-party scheduler")


    @hookimpl
    def register_attention_backends(register):
        register("fancy_attn", lambda: FancyAttention, priority=50, check=_needs_hopper)
"""
# One module listed under two groups, as a package offering two kinds from one file would do.
FANCY_EPS = {"pagedllm.schedulers": {"fancy": "fancy_plugin"}, "pagedllm.attention_backends": {"fancy": "fancy_plugin"}}

MakeDist = Callable[..., Path]


def _record(pm: PluginManager, name: str) -> plugin_manager.PluginRecord:
    matches = [r for r in pm.records if r.name == name]
    assert matches, f"no record named {name}: {pm.records}"
    return matches[0]


def _discover(pm: PluginManager) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.discover()
    return list(caught)


# -- in-tree plugins ---------------------------------------------------------------------------------------


def test_in_tree_components_come_from_the_pagedllm_distribution() -> None:
    pm = PluginManager()
    assert not _discover(pm)
    import tomllib  # 3.11+, like config.py's TOML support (pyproject still says >=3.10)

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    found = {(r.group, r.name): r for r in pm.records}
    groups = {kind.entry_point_group for kind in PluginKind}
    assert set(declared) - groups == {"pytest11"}  # the conformance kit's pytest plugin is pytest's, not ours
    for group, eps in declared.items():
        if group not in groups:
            continue
        for name, module in eps.items():
            record = found.get((group, name))
            assert record is not None, f"{group}:{name} not discovered; is the install stale? (pip install -e .)"
            assert (record.value, record.distribution, record.status) == (module, "pagedllm", "loaded")
    for kind in (PluginKind.ATTENTION, PluginKind.KV_MANAGER, PluginKind.SCHEDULER, PluginKind.LOADER):
        assert pm.components(kind), kind
        assert {c.distribution for c in pm.components(kind)} == {"pagedllm"}
    torch_backend = pm.get(PluginKind.ATTENTION, "torch")
    assert torch_backend is not None
    assert torch_backend.plugin == "pagedllm.attention_backends:torch"
    assert pm.get(PluginKind.SCHEDULER, "fcfs") is not None


# -- third-party plugins -----------------------------------------------------------------------------------


def test_third_party_distribution_is_discovered_and_attributed(fake_distribution: MakeDist) -> None:
    fake_distribution("pagedllm-fancy", FANCY_EPS, {"fancy_plugin.py": FANCY}, version="2.3")
    pm = PluginManager()
    assert not _discover(pm)  # one module under two groups is not an error

    sched = pm.get(PluginKind.SCHEDULER, "fancy")
    attn = pm.get(PluginKind.ATTENTION, "fancy_attn")
    assert sched is not None and attn is not None
    for spec in (sched, attn):
        assert (spec.distribution, spec.version) == ("pagedllm-fancy", "2.3")
    assert sched.priority == 5 and sched.description == "a third-party scheduler"
    assert sched.resolve().__name__ == "FancyScheduler"
    assert {(r.group, r.status, r.distribution) for r in pm.records if r.name == "fancy"} == {
        ("pagedllm.schedulers", "loaded", "pagedllm-fancy"),
        ("pagedllm.attention_backends", "loaded", "pagedllm-fancy"),
    }
    # In-tree components are still there, still attributed to pagedllm.
    fcfs = pm.get(PluginKind.SCHEDULER, "fcfs")
    assert fcfs is not None and fcfs.distribution == "pagedllm"


def test_plugin_failing_to_import_is_skipped_with_a_warning_and_shown_broken(
    fake_distribution: MakeDist, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_distribution(
        "pagedllm-broken",
        {"pagedllm.attention_backends": {"brokenattn": "broken_plugin"}},
        {"broken_plugin.py": "raise ImportError('needs libfoo.so')\n"},
        version="0.9",
    )
    pm = PluginManager()
    with pytest.warns(RuntimeWarning, match=r"brokenattn.*pagedllm-broken 0\.9.*needs libfoo\.so"):
        pm.discover()
    record = _record(pm, "brokenattn")
    assert (record.status, record.distribution, record.version) == ("broken", "pagedllm-broken", "0.9")
    assert "ImportError: needs libfoo.so" in record.error
    assert pm.broken() == [record]
    assert pm.get(PluginKind.ATTENTION, "torch") is not None  # the rest still loads

    # `pagedllm plugins` shows it, with its distribution and error.
    monkeypatch.setattr(plugin_manager, "_default", None)
    with pytest.warns(RuntimeWarning):
        assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "brokenattn" in line)
    assert "pagedllm-broken 0.9" in line and "broken" in line and "needs libfoo.so" in line
    assert main(["plugins", "--json"]) == 0  # the same process-wide manager: no second discovery, no warning
    data = json.loads(capsys.readouterr().out)
    entry = next(p for p in data["plugins"] if p["name"] == "brokenattn")
    assert (entry["status"], entry["distribution"]) == ("broken", "pagedllm-broken")
    assert not any(c["distribution"] == "pagedllm-broken" for c in data["components"])


def test_plugin_whose_registration_hook_raises_is_broken_and_registers_nothing(fake_distribution: MakeDist) -> None:
    source = """
        from pagedllm import hookimpl


        @hookimpl
        def register_schedulers(register):
            register("half_done", lambda: None)
            raise ValueError("config schema mismatch")
    """
    fake_distribution("pagedllm-halfdone", {"pagedllm.schedulers": {"halfdone": "halfdone_plugin"}},
                      {"halfdone_plugin.py": source})
    pm = PluginManager()
    caught = _discover(pm)
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "config schema mismatch" in str(caught[0].message)
    record = _record(pm, "halfdone")
    assert record.status == "broken" and record.distribution == "pagedllm-halfdone"
    assert "register_schedulers raised ValueError: config schema mismatch" in record.error
    # What it registered before failing is not selectable, and it is not asked again on the next collection.
    assert pm.get(PluginKind.SCHEDULER, "half_done") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.register(_Plugin("later_attn"), name="later")


def test_a_broken_module_listed_under_two_groups_is_broken_under_both(fake_distribution: MakeDist) -> None:
    source = FANCY.replace('register("fancy", lambda: FancyScheduler', 'raise RuntimeError("bad"); register("x", None')
    fake_distribution("pagedllm-fancy", FANCY_EPS, {"fancy_plugin.py": source})
    pm = PluginManager()
    assert len(_discover(pm)) == 1
    assert {(r.group, r.status) for r in pm.records if r.name == "fancy"} == {
        ("pagedllm.schedulers", "broken"),
        ("pagedllm.attention_backends", "broken"),
    }
    assert pm.get(PluginKind.ATTENTION, "fancy_attn") is None  # its other kind is withdrawn too


def test_a_plugin_asking_for_the_manager_while_imported_does_not_deadlock(
    fake_distribution: MakeDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = """
        from pagedllm.plugin_manager import get_plugin_manager

        SEEN = get_plugin_manager()  # mid-discovery: gets the manager being filled, not a hang
    """
    fake_distribution("pagedllm-eager", {"pagedllm.schedulers": {"eager": "eager_plugin"}},
                      {"eager_plugin.py": source})
    monkeypatch.setattr(plugin_manager, "_default", None)
    result: list[PluginManager] = []
    worker = threading.Thread(target=lambda: result.append(get_plugin_manager()), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert result, "get_plugin_manager() deadlocked while a plugin imported it"
    assert sys.modules["eager_plugin"].SEEN is result[0]
    assert _record(result[0], "eager").status == "loaded"


def test_allowlist_blocks_unlisted_third_party_plugins_but_never_in_tree_ones(
    fake_distribution: MakeDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_distribution("pagedllm-fancy", FANCY_EPS, {"fancy_plugin.py": FANCY})
    monkeypatch.setenv("PAGEDLLM_PLUGINS", "some-other-plugin")
    pm = PluginManager()
    pm.discover()
    assert pm.get(PluginKind.SCHEDULER, "fancy") is None
    assert {r.status for r in pm.records if r.distribution == "pagedllm-fancy"} == {"blocked"}
    assert "PAGEDLLM_PLUGINS" in _record(pm, "fancy").error
    assert "fancy_plugin" not in sys.modules  # a blocked plugin is never imported
    assert {r.status for r in pm.records if r.distribution == "pagedllm"} == {"loaded"}
    assert pm.get(PluginKind.ATTENTION, "torch") is not None

    monkeypatch.setenv("PAGEDLLM_PLUGINS", "")  # set but empty: only pagedllm's own
    pm = PluginManager()
    pm.discover()
    assert pm.get(PluginKind.SCHEDULER, "fancy") is None
    assert pm.get(PluginKind.SCHEDULER, "fcfs") is not None


@pytest.mark.parametrize("allowed", ["pagedllm-fancy", "Pagedllm_Fancy", "fancy", "other, pagedllm-fancy"])
def test_allowlist_admits_by_distribution_or_entry_point_name(
    fake_distribution: MakeDist, monkeypatch: pytest.MonkeyPatch, allowed: str
) -> None:
    fake_distribution("pagedllm-fancy", FANCY_EPS, {"fancy_plugin.py": FANCY})
    monkeypatch.setenv("PAGEDLLM_PLUGINS", allowed)
    pm = PluginManager()
    pm.discover()
    assert pm.get(PluginKind.SCHEDULER, "fancy") is not None


def test_discovery_runs_once_per_manager(fake_distribution: MakeDist, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_distribution("pagedllm-fancy", FANCY_EPS, {"fancy_plugin.py": FANCY})
    pm = PluginManager()
    pm.discover()
    records, plugins = list(pm.records), pm._pm.list_name_plugin()
    names = {kind: [c.name for c in pm.components(kind)] for kind in PluginKind}

    def no_second_scan(group: str) -> Any:
        raise AssertionError("entry points scanned twice")

    monkeypatch.setattr(plugin_manager, "_entry_points", no_second_scan)
    pm.discover()
    pm.discover()
    assert pm.records == records and pm._pm.list_name_plugin() == plugins
    assert {kind: [c.name for c in pm.components(kind)] for kind in PluginKind} == names
    assert len([r for r in pm.records if r.name == "fancy"]) == 2


def test_process_wide_manager_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin_manager, "_default", None)
    assert get_plugin_manager() is get_plugin_manager()


# -- duplicate names ---------------------------------------------------------------------------------------


class _Replacement:
    kv_cache_shape = build_metadata = make_impl = staticmethod(lambda *a: None)


class _Plugin:
    """A plugin object registered directly (llm's conftest style); records what `register` raised."""

    def __init__(self, name: str = "torch", **kwargs: Any) -> None:
        self.name, self.kwargs = name, kwargs
        self.raised: list[Exception] = []

    @hookimpl
    def register_attention_backends(self, register: Any) -> None:
        try:
            register(self.name, lambda: _Replacement, priority=7, **self.kwargs)
        except PluginLoadError as exc:
            self.raised.append(exc)
            raise


def test_duplicate_component_name_raises_and_breaks_the_later_plugin() -> None:
    pm = PluginManager()
    pm.discover()
    plugin = _Plugin()
    with pytest.warns(RuntimeWarning, match="registered twice"):
        pm.register(plugin, name="dup", distribution="pagedllm-dup", version="1.0")
    assert len(plugin.raised) == 1
    message = str(plugin.raised[0])
    assert "'torch' is registered twice" in message
    assert "pagedllm.attention_backends:torch (pagedllm)" in message and "dup (pagedllm-dup)" in message
    assert "override=True" in message
    spec = pm.get(PluginKind.ATTENTION, "torch")
    assert spec is not None and spec.distribution == "pagedllm"
    assert _record(pm, "dup").status == "broken"
    assert _record(pm, "torch").status == "loaded"  # the name clash does not smear onto the in-tree record


def test_override_true_replaces_a_component() -> None:
    pm = PluginManager()
    pm.register(_Plugin(override=True), name="better-torch", distribution="pagedllm-better")
    spec = pm.get(PluginKind.ATTENTION, "torch")
    assert spec is not None
    assert (spec.distribution, spec.priority, spec.resolve()) == ("pagedllm-better", 7, _Replacement)
    pm.unregister("better-torch")
    spec = pm.get(PluginKind.ATTENTION, "torch")
    assert spec is not None and spec.distribution == "pagedllm"


@pytest.mark.parametrize("override", [False, True])
def test_in_tree_plugins_register_first_whatever_the_sys_path_order(
    fake_distribution: MakeDist, override: bool
) -> None:
    # fake_distribution puts its folder at the *front* of sys.path, ahead of pagedllm's own metadata.
    source = f"""
        from pagedllm import hookimpl


        @hookimpl
        def register_attention_backends(register):
            register("torch", lambda: "shadow", override={override})
    """
    fake_distribution("pagedllm-shadow", {"pagedllm.attention_backends": {"shadow": "shadow_plugin"}},
                      {"shadow_plugin.py": source})
    pm = PluginManager()
    caught = _discover(pm)
    spec = pm.get(PluginKind.ATTENTION, "torch")
    assert spec is not None
    if override:
        assert not caught and spec.distribution == "pagedllm-shadow"
    else:
        assert len(caught) == 1 and spec.distribution == "pagedllm"
        assert _record(pm, "shadow").status == "broken" and _record(pm, "torch").status == "loaded"


# -- start-up cost -----------------------------------------------------------------------------------------


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_PLUGINS"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


# Modules neither `import pagedllm` nor `pagedllm plugins` may import (kernels, the server stack).
HEAVY = ("torch", "transformers", "numpy", "safetensors", "gguf", "triton", "flashinfer", "fastapi", "uvicorn",
         "zmq")


def test_import_pagedllm_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, pagedllm, pagedllm.plugin_manager, pagedllm.selector, pagedllm.config, pagedllm.cli.main\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(heavy)"
    )
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_pagedllm_plugins_is_fast_and_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom pagedllm.cli.main import main\n"
        "assert main(['plugins']) == 0\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout
    assert "torch" in result.stdout and "fcfs" in result.stdout
    import torch  # here, not in the child: its machine line (found without torch) must agree with torch's

    expected = f"machine: cuda (compute capability {torch.cuda.get_device_capability()})" \
        if torch.cuda.is_available() else "machine: cpu\n"
    assert expected in result.stdout

    # Budget CPU seconds, not wall time: the machine is shared, and waiting for a core costs no CPU.
    script = Path(sys.executable).with_name("pagedllm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pagedllm.cli.main"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([*command, "plugins"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert result.returncode == 0, result.stderr
    assert cpu < 1.5, f"`pagedllm plugins` used {cpu:.2f}s of CPU ({wall:.2f}s wall)"
    assert wall < 15, f"`pagedllm plugins` took {wall:.2f}s wall"
