"""`PAGEDLLM_PLUGIN_API`: a plugin declaring a range without the running API version (integer clauses: the
major `pagedllm.PLUGIN_API_VERSION`; dotted ones: the whole `pagedllm.API_VERSION`) is skipped with a warning
naming both versions, listed as incompatible, and a config asking for it fails clearly. Plus the rule for two
third-party plugins registering one name."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import pagedllm
from pagedllm import plugin_manager
from pagedllm.cli.main import main
from pagedllm.plugin_api import incompatibility, parse_range
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.selector import SelectionError, select

MakeDist = Callable[..., Path]

SOURCE = """
    from pagedllm import hookimpl

    PAGEDLLM_PLUGIN_API = {api!r}


    class Sched:
        add_request = schedule = update_from_output = finish_requests = has_unfinished_requests = None
        get_stats = None


    @hookimpl
    def register_schedulers(register):
        register({name!r}, lambda: Sched, description={desc!r})
"""


def _dist(make: MakeDist, dist: str, module: str, api: object, name: str = "future", desc: str = "") -> None:
    make(dist, {"pagedllm.schedulers": {module: module}},
         {f"{module}.py": SOURCE.format(api=api, name=name, desc=desc or dist)}, version="2.0")


@pytest.mark.parametrize(("spec", "ok"), [(">=1,<2", True), ("==1", True), (1, True), (">=2", False),
                                          ("<1", False), ("!=1", False), (" >= 1 , < 3 ", True)])
def test_ranges(spec: object, ok: bool) -> None:
    module = type("M", (), {"PAGEDLLM_PLUGIN_API": spec})
    assert (incompatibility(module, 1) is None) is ok


@pytest.mark.parametrize(("spec", "ok"), [
    (">=1.1,<2", True), ("==1.1.0", True), ("==1.1", True), (">=1.1.0", True), ("<=1.1", True),
    (">=1.2", False), (">1.1", False), ("!=1.1.0", False), ("==1.0", False), ("<1.1", False),
    (">=1.0.1,<1.2", True), (" >= 1.1 , < 2.0 ", True), (">=1,<1.1", False),
    # Integer clauses still compare the major only: every 1.x passes, as before.
    (">=1,<2", True), ("==1", True), (1, True), (">1", False), ("!=1", False),
])
def test_dotted_ranges_against_the_full_api_version(spec: object, ok: bool) -> None:
    module = type("M", (), {"PAGEDLLM_PLUGIN_API": spec})
    assert (incompatibility(module, "1.1.0") is None) is ok


def test_dotted_clauses_parse_to_tuples_integers_stay_majors() -> None:
    assert parse_range(">=1.1,<2") == [(">=", (1, 1)), ("<", 2)]
    assert parse_range("1.1.0") == [("==", (1, 1, 0))]
    # An int current (the major alone) is N.0.0 to a dotted clause.
    assert incompatibility(type("M", (), {"PAGEDLLM_PLUGIN_API": ">=1.0"}), 1) is None
    assert incompatibility(type("M", (), {"PAGEDLLM_PLUGIN_API": ">=1.1"}), 1) is not None


def test_a_plugin_needing_a_later_minor_is_incompatible_naming_both_versions() -> None:
    assert pagedllm.API_VERSION == "1.9.0"
    why = incompatibility(type("M", (), {"PAGEDLLM_PLUGIN_API": ">=1.10,<2"}), pagedllm.API_VERSION)
    assert why == "supports pagedllm plugin API '>=1.10,<2' but this pagedllm provides plugin API 1.9.0"


def test_a_malformed_range_is_an_incompatibility_naming_it() -> None:
    with pytest.raises(ValueError, match="'~1'"):
        parse_range("~1")
    assert "'~1'" in (incompatibility(type("M", (), {"PAGEDLLM_PLUGIN_API": "~1"}), 1) or "")


@pytest.mark.parametrize("bad", ["1.", ">=1..2", "1.x", ">=v1", ">=1,", "=>1", "1.1.0-rc1"])
def test_malformed_dotted_clauses_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not '<op><version>'"):
        parse_range(bad)
    module = type("M", (), {"PAGEDLLM_PLUGIN_API": bad})
    assert "is not '<op><version>'" in (incompatibility(module, "1.1.0") or "")


def test_no_declaration_means_compatible() -> None:
    assert incompatibility(object(), pagedllm.PLUGIN_API_VERSION) is None


def test_incompatible_plugin_is_skipped_listed_and_refused_when_requested(
    fake_distribution: MakeDist, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _dist(fake_distribution, "pagedllm-future", "future_plugin", ">=2,<3")
    pm = PluginManager()
    with pytest.warns(RuntimeWarning) as caught:
        pm.discover()
    message = str(caught[0].message)
    assert "'future_plugin'" in message and "pagedllm-future 2.0" in message
    assert "supports pagedllm plugin API '>=2,<3' but this pagedllm provides plugin API 1" in message
    assert pm.get(PluginKind.SCHEDULER, "future") is None  # never registered
    record = next(r for r in pm.records if r.name == "future_plugin")
    assert record.status == "incompatible"

    with pytest.raises(SelectionError) as info:
        select(pm, PluginKind.SCHEDULER, None, requested="future")
    text = str(info.value)
    assert "no scheduler named 'future'" in text
    assert "from distribution pagedllm-future 2.0 is incompatible" in text and "provides plugin API 1" in text
    # Not asked for: the default is chosen as usual.
    assert select(pm, PluginKind.SCHEDULER, None, requested="fcfs").winner.name == "fcfs"

    monkeypatch.setattr(plugin_manager, "_default", None)
    with pytest.warns(RuntimeWarning):
        assert main(["plugins"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "future_plugin" in ln)
    assert "pagedllm-future 2.0: incompatible" in line and "'>=2,<3'" in line
    assert main(["plugins", "--json"]) == 0
    entry = next(p for p in json.loads(capsys.readouterr().out)["plugins"] if p["name"] == "future_plugin")
    assert entry["status"] == "incompatible" and "plugin API 1" in entry["error"]


@pytest.mark.parametrize(
    "api",
    [">=1,<2", ">=1.1,<2", ">=1.2,<2", ">=1.3,<2", ">=1.4,<2", ">=1.5,<2", ">=1.6,<2", ">=1.7,<2", ">=1.8,<2", ">=1.9,<2", "==1.9.0"],
)
def test_compatible_declaration_loads_silently(fake_distribution: MakeDist, api: str) -> None:
    _dist(fake_distribution, "pagedllm-now", "now_plugin", api, name="now")
    pm = PluginManager()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.discover()
    assert pm.get(PluginKind.SCHEDULER, "now") is not None


def test_a_plugin_needing_a_later_minor_is_skipped_and_listed_incompatible(fake_distribution: MakeDist) -> None:
    _dist(fake_distribution, "pagedllm-newer", "newer_plugin", ">=1.10,<2", name="newer")
    pm = PluginManager()
    with pytest.warns(RuntimeWarning, match=r"supports pagedllm plugin API '>=1.10,<2' but this pagedllm "
                                            r"provides plugin API 1\.9\.0"):
        pm.discover()
    assert pm.get(PluginKind.SCHEDULER, "newer") is None
    assert next(r for r in pm.records if r.name == "newer_plugin").status == "incompatible"


@pytest.mark.parametrize("reverse", [False, True])
def test_two_third_party_plugins_with_one_name_resolve_by_distribution_name(
    fake_distribution: MakeDist, reverse: bool
) -> None:
    # fake_distribution prepends to sys.path: the later-made one comes first on the path.
    dists = [("pagedllm-aaa", "aaa_plugin"), ("pagedllm-zzz", "zzz_plugin")]
    for dist, module in reversed(dists) if reverse else dists:
        _dist(fake_distribution, dist, module, ">=1", name="same")
    pm = PluginManager()
    with pytest.warns(RuntimeWarning, match="registered twice") as caught:
        pm.discover()
    spec = pm.get(PluginKind.SCHEDULER, "same")
    assert spec is not None and spec.distribution == "pagedllm-aaa"  # first in name order keeps it
    message = str(caught[0].message)
    assert "pagedllm-aaa" in message and "pagedllm-zzz" in message and "override=True" in message
    assert next(r for r in pm.records if r.name == "zzz_plugin").status == "broken"
