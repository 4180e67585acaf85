"""Typed plugin contracts: required members come from the protocol classes, `register` and the check contexts
are typed (mypy rejects a wrong registration), and pagedllm.api stays light."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pytest

from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import (
    ComponentSpec,
    PluginKind,
    PluginLoadError,
    optional,
    protocol_of,
    required_members,
    required_members_of,
)

ROOT = Path(__file__).resolve().parents[1]

# What plugin_spec._REQUIRED listed by hand before the names were derived from the protocol classes.
HAND_LISTED: dict[PluginKind, tuple[str, ...]] = {
    PluginKind.ATTENTION: ("kv_cache_shape", "build_metadata", "make_impl"),
    PluginKind.SCHEDULER: ("add_request", "schedule", "update_from_output", "finish_requests",
                           "has_unfinished_requests", "get_stats"),
    PluginKind.LOADER: ("load_info", "load_weights"),
    PluginKind.KV_MANAGER: ("allocate_new_blocks", "free", "get_blocks"),
    PluginKind.LOGITS_PROCESSOR: ("apply",),
    PluginKind.PROPOSER: ("propose", "remove_requests"),
    PluginKind.ENTRYPOINT: ("__call__",),
    PluginKind.EXECUTOR: ("start", "bind", "execute_model", "check_health", "shutdown"),
}
# The one difference, on purpose: the KV coordinator calls every method of SingleTypeKVCacheManager
# unconditionally, so a manager lacking one of these failed on the first request; now it fails when resolved.
# Every in-tree manager (and any SingleTypeKVCacheManagerBase subclass) has them all.
ADDED = {
    PluginKind.KV_MANAGER: ("get_num_blocks_to_allocate", "save_new_computed_blocks", "cache_blocks",
                            "find_longest_cache_hit", "remove_skipped_blocks"),
    PluginKind.COMMAND: ("add_parser",),  # a kind added after the hand list (pagedllm.protocols.command)
    PluginKind.TOOL_PARSER: ("extract_tool_calls", "extract_tool_calls_streaming"),  # added later too
    PluginKind.REASONING_PARSER: ("extract_reasoning_content", "extract_reasoning_content_streaming"),
    PluginKind.STRUCTURED_OUTPUT: ("validate", "compile", "make_grammar"),  # a backend class
    PluginKind.KV_CONNECTOR: ("on_device_evict", "get_num_new_matched_tokens", "update_state_after_alloc",
                              "build_connector_meta", "stats", "register_kv_caches", "start_load_kv"),
}
# Methods the protocols define but mark @optional, which the hand list had left out for that reason: the
# engine asks for execute_pipelined with getattr, never calls a loader class's check() (selection runs the
# registration's check=) nor a scheduler's get_num_unfinished_requests.
OPTIONAL = {
    PluginKind.EXECUTOR: ("execute_pipelined",),
    PluginKind.LOADER: ("check",),
    PluginKind.SCHEDULER: ("get_num_unfinished_requests",),
}


@pytest.mark.parametrize("kind", list(PluginKind))
def test_required_members_are_the_protocols_and_match_the_old_hand_list(kind: PluginKind) -> None:
    derived = required_members_of(kind)
    hand = HAND_LISTED.get(kind, ())  # models and quantization configs are checked by building: none
    assert set(derived) == set(hand) | set(ADDED.get(kind, ()))
    # Order kept where nothing was added: resolve()'s message lists what is missing in this order.
    assert [m for m in derived if m in hand] == list(hand)
    for name in OPTIONAL.get(kind, ()):
        assert name not in derived
        assert getattr(getattr(_protocol(kind), name), "__pagedllm_optional__", False), name


def _protocol(kind: PluginKind) -> Any:
    protocol = protocol_of(kind)
    assert protocol is not None
    return protocol


class _Base(Protocol):
    def inherited(self) -> None: ...

    def overridden_optional(self) -> None: ...


class _Toy(_Base, Protocol):
    name: ClassVar[str]  # data members are left out: a class has them only once instantiated

    def __call__(self) -> None: ...

    def __len__(self) -> int: ...

    def _private(self) -> None: ...

    @staticmethod
    def static() -> None: ...

    @classmethod
    def klass(cls) -> None: ...

    @optional
    def maybe(self) -> None: ...

    @optional
    @staticmethod
    def maybe_static() -> None: ...

    @optional
    def overridden_optional(self) -> None: ...

    @property
    def prop(self) -> int: ...


def test_required_members_rules() -> None:
    assert required_members(_Toy) == ("inherited", "__call__", "static", "klass")


def test_in_tree_components_satisfy_their_derived_protocols() -> None:
    pm = PluginManager()
    kinds = (PluginKind.KV_MANAGER, PluginKind.SCHEDULER, PluginKind.LOADER, PluginKind.EXECUTOR)
    resolved = []
    for kind in kinds:
        for spec in pm.components(kind):
            if spec.distribution != "pagedllm" or spec.requires:
                continue  # those import their packages (ray, gguf): left to their own tests
            resolved.append((kind, spec.name, spec.resolve()))
    assert {(k, n) for k, n, _ in resolved} >= {
        (PluginKind.KV_MANAGER, "full_attention"), (PluginKind.KV_MANAGER, "sliding_window"),
        (PluginKind.KV_MANAGER, "mamba"), (PluginKind.SCHEDULER, "fcfs"), (PluginKind.LOADER, "hf"),
        (PluginKind.EXECUTOR, "uniproc"), (PluginKind.EXECUTOR, "multiproc"),
    }


def test_a_kv_manager_missing_a_coordinator_method_fails_when_resolved() -> None:
    class HalfManager:
        allocate_new_blocks = free = get_blocks = None  # the old hand list: enough before, not now

    spec = ComponentSpec(PluginKind.KV_MANAGER, "half", lambda: HalfManager, plugin="p", distribution="d")
    with pytest.raises(PluginLoadError, match=r"missing get_num_blocks_to_allocate, save_new_computed_blocks, "
                                              r"cache_blocks, find_longest_cache_hit, remove_skipped_blocks"):
        spec.resolve()


def test_typed_registrations_behave_as_untyped_ones() -> None:
    from pagedllm.api import (
        FullAttentionSpec,
        RegisterKVManager,
        RegisterScheduler,
        SchedulerCheckContext,
        hookimpl,
    )

    def _check(ctx: SchedulerCheckContext) -> list[str]:
        return [] if ctx.max_num_seqs < 100 else ["too many"]

    class Plugin:
        @hookimpl
        def register_schedulers(self, register: RegisterScheduler) -> None:
            register("typed", lambda: object, priority=3, requires=["json"], check=_check, explicit_only=True)

        @hookimpl
        def register_kv_managers(self, register: RegisterKVManager) -> None:
            register("typed_kv", lambda: object, spec_type=FullAttentionSpec, override=False, note="meta")

    pm = PluginManager()
    pm.register(Plugin(), name="typed-plugin")
    sched = pm.get(PluginKind.SCHEDULER, "typed")
    kv = pm.get(PluginKind.KV_MANAGER, "typed_kv")
    assert sched is not None and kv is not None
    assert (sched.priority, sched.requires, sched.meta) == (3, ("json",), {"explicit_only": True})
    assert kv.meta == {"spec_type": FullAttentionSpec, "override": False, "note": "meta"}
    from pagedllm.config import SchedulerConfig

    assert sched.reasons_against(SchedulerConfig(max_num_seqs=8)) == []
    assert sched.reasons_against(SchedulerConfig(max_num_seqs=128)) == ["too many"]


# -- mypy sees the contracts --------------------------------------------------------------------------------

BAD = '''
from pagedllm.api import (
    AttentionSelectionContext, ExecutorCheckContext, FullAttentionSpec, QuantizationCheckContext,
    RegisterAttentionBackend, RegisterExecutor, RegisterKVManager, RegisterQuantizationMethod,
    RegisterScheduler, SlidingWindowSpec, hookimpl,
)


def _window(spec: SlidingWindowSpec) -> list[str]:
    return [] if spec.sliding_window else ["no window"]


def _attn(ctx: AttentionSelectionContext) -> list[str]:
    return [] if ctx.head_size <= 256 else ["head size"]


def _mutates(parallel: ExecutorCheckContext) -> list[str]:
    parallel.tensor_parallel_size = 1  # BAD: read-only
    return []


def _quant(qc: QuantizationCheckContext) -> list[str]:
    return [] if qc else ["no quantization_config"]


@hookimpl
def register_schedulers(register: RegisterScheduler) -> None:
    register("ok", lambda: object, priority=1, requires=["x"], explicit_only=True, anything="meta")
    register("bad", lambda: object, priority="high")  # BAD: priority
    register("bad2", lambda: object, check=_attn)  # BAD: check


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    register("ok", lambda: object, spec_type=SlidingWindowSpec, check=_window)
    register("bad", lambda: object, spec_type=FullAttentionSpec, check=_window)  # BAD: check
    register("bad2", lambda: object)  # BAD: spec_type


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    register("ok", lambda: object, check=_attn, priority_for=lambda ctx: 1 if ctx.cuda_graphs else 2)
    register("bad", lambda: object, priority_for=lambda ctx: ctx.nonexistent)  # BAD: nonexistent


@hookimpl
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    register("ok", lambda: object, check=_quant, description="d")
    register("bad", lambda: object, requires="gguf")  # BAD: requires


@hookimpl
def register_executors(register: RegisterExecutor) -> None:
    register("ok", lambda: object, check=_mutates)
'''

CONFORMS = '''
from typing import Any

from pagedllm.api import Register, RegisterAttentionBackend, RegisterKVManager
from pagedllm.plugin_manager import _Registrar


def conforms(r: _Registrar) -> None:
    # What the plugin manager hands to hooks accepts every call the protocols allow.
    a: RegisterAttentionBackend = r
    k: RegisterKVManager = r
    g: Register[Any] = r
'''


def test_mypy_checks_registrations_and_contexts(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    # mypy cannot follow the editable install's import hook: give it `pagedllm` as a folder.
    src = tmp_path / "src"
    src.mkdir()
    (src / "pagedllm").symlink_to(ROOT / "core", target_is_directory=True)
    config = tmp_path / "mypy.ini"
    config.write_text(textwrap.dedent(f"""\
        [mypy]
        python_version = 3.11
        mypy_path = {src}
        plugins = pydantic.mypy
        ignore_missing_imports = True
        follow_imports = silent
        cache_dir = {tmp_path / "cache"}
        [mypy-torch.*,triton.*,pagedllm.engine.*,pagedllm.request,pagedllm.sched.*,pagedllm.cli.*]
        follow_imports = skip
        """))
    bad = tmp_path / "bad.py"
    bad.write_text(BAD)
    good = tmp_path / "conforms.py"
    good.write_text(CONFORMS)
    # The in-tree registration modules, and the check contexts' conformance with the config sections.
    registration = sorted(p for p in (ROOT / "plugins").rglob("*.py") if "\ndef register_" in p.read_text())
    assert len(registration) > 20
    targets = [bad, good, src / "pagedllm" / "selection_context.py", src / "pagedllm" / "hookspecs.py",
               src / "pagedllm" / "api" / "__init__.py", *registration]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), *map(str, targets)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode != 0, result.stdout
    # Each line marked `# BAD: <word>` gets an error naming <word> (the argument or member); nothing else does.
    expected = {n: line.split("# BAD: ")[1] for n, line in enumerate(BAD.splitlines(), 1) if "# BAD: " in line}
    found: dict[int, str] = {}
    for error in errors:
        path, number, message = error.split(":", 2)
        assert Path(path).name == "bad.py", f"unexpected error outside the bad snippet: {error}"
        found[int(number)] = found.get(int(number), "") + message
    assert set(found) == set(expected), result.stdout
    for lineno, word in expected.items():
        assert word in found[lineno], (lineno, word, found[lineno])


def test_pagedllm_api_stays_light() -> None:
    code = ("import sys, pagedllm.api as api; assert 'torch' not in sys.modules, 'torch'; "
            "assert 'pydantic' not in sys.modules, 'pydantic'; "
            "assert api.RegisterScheduler and api.SchedulerCheckContext and api.QuantizationCheckContext")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_symlinked_core_is_the_imported_one() -> None:
    # The mypy test checks `core/` through a symlink named pagedllm: it must be what `import pagedllm` finds.
    import pagedllm

    assert Path(pagedllm.__file__).resolve().parent == (ROOT / "core").resolve()
