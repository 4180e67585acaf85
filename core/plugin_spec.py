"""What a plugin registers: one record per component, with enough facts to select and explain."""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar


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
    COMMAND = "command"
    STRUCTURED_OUTPUT = "structured_output"
    TOOL_PARSER = "tool_parser"
    REASONING_PARSER = "reasoning_parser"
    KV_CONNECTOR = "kv_connector"

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
    PluginKind.COMMAND: "register_commands",
    PluginKind.STRUCTURED_OUTPUT: "register_structured_output_backends",
    PluginKind.TOOL_PARSER: "register_tool_parsers",
    PluginKind.REASONING_PARSER: "register_reasoning_parsers",
    PluginKind.KV_CONNECTOR: "register_kv_connectors",
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
    PluginKind.COMMAND: "pagedllm.commands",
    PluginKind.STRUCTURED_OUTPUT: "pagedllm.structured_output",
    PluginKind.TOOL_PARSER: "pagedllm.tool_parsers",
    PluginKind.REASONING_PARSER: "pagedllm.reasoning_parsers",
    PluginKind.KV_CONNECTOR: "pagedllm.kv_connectors",
}
# A light structural check at resolve time (STYLE.md failure policy): the object each kind's `load()` returns
# must carry its protocol's required members (`required_members`), so a registration whose load() gives the
# wrong thing fails when resolved, naming its plugin and distribution, instead of deep inside the engine.
# Models and quantization configs are checked by building. Named here, imported at resolve time: the protocol
# modules import torch (resolve() runs after load(), when it is imported anyway) and this module stays light.
# The command protocol is the exception, typing only: `pagedllm --help` resolves every command plugin.
_PROTOCOLS: dict[PluginKind, str] = {
    PluginKind.ATTENTION: "pagedllm.protocols.attention:AttentionBackend",
    PluginKind.SCHEDULER: "pagedllm.protocols.scheduler:Scheduler",
    PluginKind.LOADER: "pagedllm.protocols.loader:ModelLoader",
    PluginKind.KV_MANAGER: "pagedllm.protocols.kv_manager:SingleTypeKVCacheManager",
    PluginKind.LOGITS_PROCESSOR: "pagedllm.sample.logits_processor:LogitsProcessor",
    PluginKind.PROPOSER: "pagedllm.spec_decode.proposer:Proposer",
    PluginKind.ENTRYPOINT: "pagedllm.protocols.entrypoint:Entrypoint",
    PluginKind.EXECUTOR: "pagedllm.protocols.executor:Executor",
    PluginKind.COMMAND: "pagedllm.protocols.command:Command",
    PluginKind.STRUCTURED_OUTPUT: "pagedllm.protocols.structured_output:StructuredOutputBackend",
    PluginKind.TOOL_PARSER: "pagedllm.protocols.tool_parser:ToolParser",
    PluginKind.REASONING_PARSER: "pagedllm.protocols.reasoning_parser:ReasoningParser",
    PluginKind.KV_CONNECTOR: "pagedllm.protocols.kv_connector:KVConnector",
}
_OPTIONAL = "__pagedllm_optional__"
_F = TypeVar("_F")


def optional(member: _F) -> _F:
    """Mark a protocol method optional: not among its `required_members`, so a component may lack it.

    Apply it to the function (above or below `@staticmethod`) and say in its docstring what the engine does
    without it.
    """
    setattr(member, _OPTIONAL, True)
    return member


def required_members(protocol: type) -> tuple[str, ...]:
    """The members a component satisfying `protocol` must have, in definition order (base protocols first).

    Those are the methods (plain, static or class methods) defined on the protocol class and its protocol
    bases, except private names and dunders (`__call__` counts: it is what a callable protocol requires) and
    methods marked `@optional`. Data members and properties are left out: a class provides them only once
    instantiated, and the check looks at what `load()` returns, usually a class.
    """
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls.__module__ in ("typing", "typing_extensions"):  # Protocol, Generic
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") and name != "__call__":
                continue
            func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if not inspect.isfunction(func):
                continue
            if getattr(value, _OPTIONAL, False) or getattr(func, _OPTIONAL, False):
                names.pop(name, None)
            else:
                names[name] = None
    return tuple(names)


def protocol_of(kind: PluginKind) -> type | None:
    """The protocol class `kind`'s components are checked against when resolved (None: checked by building)."""
    path = _PROTOCOLS.get(kind)
    if path is None:
        return None
    module, _, qualname = path.partition(":")
    protocol: type = getattr(importlib.import_module(module), qualname)
    return protocol


@functools.cache
def required_members_of(kind: PluginKind) -> tuple[str, ...]:
    """`required_members` of `kind`'s protocol (empty for kinds checked by building); imports the protocol."""
    protocol = protocol_of(kind)
    return () if protocol is None else required_members(protocol)


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
        missing = [attr for attr in required_members_of(self.kind) if not hasattr(obj, attr)]
        if missing:
            raise PluginLoadError(
                f"{self.kind.value} '{self.name}' from plugin '{self.plugin}' "
                f"(distribution {self.distribution or '?'} {self.version}) loaded {obj!r}, which does not "
                f"satisfy the {self.kind.value} protocol: missing {', '.join(missing)} (see docs/plugins/)"
            )
        return obj


class PluginLoadError(RuntimeError):
    """A plugin or component could not be imported or registered."""
