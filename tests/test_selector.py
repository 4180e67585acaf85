"""The selector's priority walk and its explanations, with capabilities faked through the selection context."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pagedllm import hookimpl
from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import ComponentSpec, PluginKind, PluginLoadError
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.selector import SelectionError, select

CPU = AttentionSelectionContext("cpu", None, "float32", "auto", 64, 16)
H100 = AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16)
A100 = replace(H100, compute_capability=(8, 0))


def _needs_hopper(ctx: AttentionSelectionContext) -> list[str]:
    reasons = []
    if ctx.device_type != "cuda":
        reasons.append(f"needs a CUDA device, not {ctx.device_type}")
    elif ctx.compute_capability is None or ctx.compute_capability < (9, 0):
        reasons.append(f"needs compute capability >= 9.0, not {ctx.compute_capability}")
    return reasons


class HopperBackend:
    """Satisfies the backend protocol structurally (resolve() checks the names, never calls them)."""

    name = "hopper"
    kv_cache_shape = build_metadata = make_impl = staticmethod(lambda *a: None)


class _FakeBackends:
    """Two kernel backends as a third-party plugin would register them, beside the in-tree `torch` one."""

    @hookimpl
    def register_attention_backends(self, register: Any) -> None:
        register("hopper", lambda: HopperBackend, priority=20, check=_needs_hopper)
        register("needs_pkg", lambda: "PkgBackend", priority=10, requires=("surely_not_installed_pkg",))


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    manager = PluginManager()
    manager.register(_FakeBackends(), name="fake-backends", distribution="pagedllm-fake", version="0.1")
    return manager


def _select(pm: PluginManager, ctx: Any, **kwargs: Any) -> Any:
    """Select among the fakes and the in-tree torch backend only: other in-tree kernel backends (triton, when
    installed) would otherwise take part and change the expected winners."""
    if "candidates" not in kwargs:
        kwargs["candidates"] = [
            c for c in pm.components(PluginKind.ATTENTION) if c.distribution != "pagedllm" or c.name == "torch"
        ]
    return select(pm, PluginKind.ATTENTION, ctx, **kwargs)


def _reasons(selection: Any) -> dict[str, list[str]]:
    return {spec.name: reasons for spec, reasons in selection.rejected}


def test_on_cpu_the_torch_backend_wins_and_each_loser_says_why(pm: PluginManager) -> None:
    selection = _select(pm, CPU)
    assert selection.winner.name == "torch" and selection.winner.distribution == "pagedllm"
    assert _reasons(selection) == {
        "hopper": ["needs a CUDA device, not cpu"],
        "needs_pkg": ["package providing 'surely_not_installed_pkg' is not installed"],
    }
    lines = selection.explain().splitlines()
    assert lines[0].startswith("attention_backend: torch (highest priority that passed its checks; priority 0")
    assert "from pagedllm" in lines[0]
    assert "  - hopper: needs a CUDA device, not cpu" in lines
    assert "  - needs_pkg: package providing 'surely_not_installed_pkg' is not installed" in lines


def test_on_hopper_the_highest_priority_capable_backend_wins(pm: PluginManager) -> None:
    selection = _select(pm, H100)
    assert selection.winner.name == "hopper" and selection.winner.distribution == "pagedllm-fake"
    assert selection.load() is HopperBackend
    reasons = _reasons(selection)
    assert reasons["torch"] == ["lower priority (0) than hopper (20)"]  # capable, just outranked
    assert reasons["needs_pkg"] == ["package providing 'surely_not_installed_pkg' is not installed"]
    assert "hopper (highest priority that passed its checks; priority 20, from pagedllm-fake)" in selection.explain()


def test_on_ampere_the_capability_check_rejects_the_kernel_backend(pm: PluginManager) -> None:
    selection = _select(pm, A100)
    assert selection.winner.name == "torch"
    assert _reasons(selection)["hopper"] == ["needs compute capability >= 9.0, not (8, 0)"]


def test_requested_backend_is_used_even_when_outranked(pm: PluginManager) -> None:
    selection = _select(pm, H100, requested="torch")
    assert selection.winner.name == "torch" and selection.requested == "torch"
    assert "torch (requested by config; priority 0, from pagedllm)" in selection.explain()
    assert _reasons(selection) == {"hopper": ["not requested"], "needs_pkg": ["not requested"]}
    by_checkpoint = _select(pm, H100, requested="torch", requested_by="checkpoint")
    assert "torch (requested by checkpoint;" in by_checkpoint.explain()


def test_unknown_requested_name_lists_the_available_ones(pm: PluginManager) -> None:
    with pytest.raises(SelectionError, match=r"no attention_backend named 'flash'; available: hopper, needs_pkg, torch"):
        _select(pm, CPU, requested="flash")


@pytest.mark.parametrize(
    ("requested", "context", "reason"),
    [
        ("hopper", A100, "needs compute capability >= 9.0, not (8, 0)"),
        ("needs_pkg", H100, "package providing 'surely_not_installed_pkg' is not installed"),
        ("torch", replace(CPU, kv_cache_dtype="float16"), "kv cache dtype float16 not supported"),
    ],
)
def test_requested_but_incapable_backend_fails_with_its_reasons(
    pm: PluginManager, requested: str, context: AttentionSelectionContext, reason: str
) -> None:
    with pytest.raises(SelectionError) as info:
        _select(pm, context, requested=requested)
    assert f"'{requested}'" in str(info.value) and "was requested but cannot be used" in str(info.value)
    assert reason in str(info.value)


def test_no_capable_candidate_lists_every_reason(pm: PluginManager) -> None:
    with pytest.raises(SelectionError) as info:
        _select(pm, replace(CPU, kv_cache_dtype="float16"))
    message = str(info.value)
    assert message.startswith("no usable attention_backend for AttentionSelectionContext(")
    assert "hopper: needs a CUDA device, not cpu" in message
    assert "needs_pkg: package providing 'surely_not_installed_pkg' is not installed" in message
    assert "torch: kv cache dtype float16 not supported" in message


def test_no_candidates_at_all(pm: PluginManager) -> None:
    with pytest.raises(SelectionError, match="no candidates registered"):
        _select(pm, CPU, candidates=[])


def _spec(name: str, priority: int = 0, **kwargs: Any) -> ComponentSpec:
    return ComponentSpec(PluginKind.ATTENTION, name, lambda: name, priority=priority, plugin="p", distribution="d",
                         **kwargs)


def test_ties_go_to_the_earlier_registration_and_a_crashing_check_is_a_reason(pm: PluginManager) -> None:
    def crash(ctx: Any) -> list[str]:
        raise KeyError("head_size")

    pool = [_spec("crashy", 9, check=crash), _spec("first", 1), _spec("second", 1)]
    selection = _select(pm, CPU, candidates=pool)
    assert selection.winner.name == "first"
    reasons = _reasons(selection)
    assert reasons["crashy"] == ["capability check failed: KeyError: 'head_size'"]
    assert reasons["second"] == ["lower priority (1) than first (1)"]


def test_a_missing_parent_package_is_a_reason_not_a_crash() -> None:
    assert _spec("x", requires=("surely_not_installed_pkg.sub",)).missing_requirements() == [
        "package providing 'surely_not_installed_pkg.sub' is not installed"
    ]


def test_a_winner_that_fails_to_import_names_its_plugin_and_distribution(pm: PluginManager) -> None:
    def boom() -> Any:
        raise ImportError("libkernel.so: cannot open shared object file")

    spec = ComponentSpec(PluginKind.ATTENTION, "kern", boom, plugin="pagedllm.attention_backends:kern",
                         distribution="pagedllm-kern", version="1.2")
    selection = _select(pm, CPU, candidates=[spec])
    with pytest.raises(PluginLoadError, match=r"'kern' from plugin 'pagedllm.attention_backends:kern' "
                                              r"\(distribution pagedllm-kern 1.2\) failed to load: ImportError"):
        selection.load()


def test_a_winner_that_does_not_satisfy_the_protocol_names_what_is_missing(pm: PluginManager) -> None:
    spec = ComponentSpec(PluginKind.ATTENTION, "wrong", lambda: "not a backend", plugin="pagedllm.attention_backends:wrong",
                         distribution="pagedllm-wrong", version="0.3")
    selection = _select(pm, CPU, candidates=[spec])
    with pytest.raises(PluginLoadError) as info:
        selection.load()
    message = str(info.value)
    assert "'wrong' from plugin 'pagedllm.attention_backends:wrong' (distribution pagedllm-wrong 0.3)" in message
    assert "does not satisfy the attention_backend protocol: missing kv_cache_shape, build_metadata, make_impl" in message


@pytest.mark.parametrize("requested", ["flashy", "flash_attn"])
def test_requested_component_of_a_broken_plugin_names_its_distribution_and_error(
    fake_distribution: Callable[..., Path], requested: str
) -> None:
    # The entry point is `flashy`; the component it would have registered may be named differently.
    fake_distribution(
        "pagedllm-flashy",
        {"pagedllm.attention_backends": {"flashy": "flashy_plugin"}},
        {"flashy_plugin.py": "raise OSError('libcudart.so.13: cannot open shared object file')\n"},
        version="3.1",
    )
    pm = PluginManager()
    with pytest.warns(RuntimeWarning):
        pm.discover()
    with pytest.raises(SelectionError) as info:
        _select(pm, H100, requested=requested)
    message = str(info.value)
    assert f"no attention_backend named '{requested}'; available: torch" in message
    assert "plugin 'flashy' (flashy_plugin) from distribution pagedllm-flashy 3.1 is broken" in message
    assert "OSError: libcudart.so.13: cannot open shared object file" in message
