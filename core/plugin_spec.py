"""What a plugin registers: one record per component, with enough facts to select and explain."""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class PluginKind(enum.StrEnum):
    ATTENTION = "attention_backend"
    KV_MANAGER = "kv_manager"
    SCHEDULER = "scheduler"
    LOADER = "loader"
    QUANTIZATION = "quantization"
    MODEL = "model"
    ENTRYPOINT = "entrypoint"
    LOGITS_PROCESSOR = "logits_processor"
    PROPOSER = "proposer"
    EXECUTOR = "executor"

    @property
    def hook_name(self) -> str:
        return _HOOKS[self]

    @property
    def entry_point_group(self) -> str:
        return _GROUPS[self]


_HOOKS = {
    PluginKind.ATTENTION: "register_attention_backends",
    PluginKind.KV_MANAGER: "register_kv_managers",
    PluginKind.SCHEDULER: "register_schedulers",
    PluginKind.LOADER: "register_loaders",
    PluginKind.QUANTIZATION: "register_quantization_methods",
    PluginKind.MODEL: "register_models",
    PluginKind.ENTRYPOINT: "register_entrypoints",
    PluginKind.LOGITS_PROCESSOR: "register_logits_processors",
    PluginKind.PROPOSER: "register_proposers",
    PluginKind.EXECUTOR: "register_executors",
}
_GROUPS = {
    PluginKind.ATTENTION: "pagedllm.attention_backends",
    PluginKind.KV_MANAGER: "pagedllm.kv_managers",
    PluginKind.SCHEDULER: "pagedllm.schedulers",
    PluginKind.LOADER: "pagedllm.loaders",
    PluginKind.QUANTIZATION: "pagedllm.quantization",
    PluginKind.MODEL: "pagedllm.models",
    PluginKind.ENTRYPOINT: "pagedllm.entrypoints",
    PluginKind.LOGITS_PROCESSOR: "pagedllm.logits_processors",
    PluginKind.PROPOSER: "pagedllm.proposers",
    PluginKind.EXECUTOR: "pagedllm.executors",
}
# A light structural check at resolve time (STYLE.md failure policy): the names each kind's `load()` result
# must carry, so a registration whose load() gives the wrong thing fails when resolved, naming its plugin and
# distribution, instead of deep inside the engine. Models and quantization configs are checked by building.
_REQUIRED: dict[PluginKind, tuple[str, ...]] = {
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


@dataclass
class ComponentSpec:
    kind: PluginKind
    name: str
    load: Callable[[], Any]
    priority: int = 0
    requires: tuple[str, ...] = ()
    check: Callable[[Any], list[str]] | None = None
    description: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # Filled in by the plugin manager: who registered it.
    plugin: str = ""
    distribution: str = ""
    version: str = ""

    def missing_requirements(self) -> list[str]:
        """Reasons from `requires`, found without importing anything."""
        reasons = []
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                reasons.append(f"package providing '{module}' is not installed")
        return reasons

    def reasons_against(self, context: Any) -> list[str]:
        """Every reason this component cannot serve `context` (empty: it can)."""
        reasons = self.missing_requirements()
        if reasons or self.check is None:
            return reasons
        try:
            return list(self.check(context))
        except Exception as exc:  # a broken check is a reason, not a crash
            return [f"capability check failed: {type(exc).__name__}: {exc}"]

    def resolve(self) -> Any:
        """Import and return the component; an import failure names the plugin and its distribution."""
        try:
            obj = self.load()
        except Exception as exc:
            raise PluginLoadError(
                f"{self.kind.value} '{self.name}' from plugin '{self.plugin}' "
                f"(distribution {self.distribution or '?'} {self.version}) failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        missing = [attr for attr in _REQUIRED.get(self.kind, ()) if not hasattr(obj, attr)]
        if missing:
            raise PluginLoadError(
                f"{self.kind.value} '{self.name}' from plugin '{self.plugin}' "
                f"(distribution {self.distribution or '?'} {self.version}) loaded {obj!r}, which does not "
                f"satisfy the {self.kind.value} protocol: missing {', '.join(missing)} (see docs/plugins/)"
            )
        return obj


class PluginLoadError(RuntimeError):
    """A plugin or component could not be imported or registered."""
