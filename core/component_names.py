"""Config keys that name plugin components, checked by name against plugin discovery.

`pagedllm config validate`, `serve` and the other commands run this before any engine is built, so a typo in
`scheduler.name` or `kv_transfer.kv_connector` fails at once with the selector's explanation (the names it
knows, the closest match), not minutes into a model load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.config import ConfigError, EngineConfig
from pagedllm.plugin_spec import PluginKind

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager


class ComponentNameError(ConfigError):
    """Config keys that name components no installed plugin registers; `problems` holds one line per key."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  {p}" for p in problems))


# Every config key that names a plugin component, and the kind it names (a list key names one per item).
# `None` is "choose for me" (or "off") for each; other values must be registered names, as the selector only
# accepts names it knows. A new key that names a component belongs here, or a typo in it dies in the build.
COMPONENT_KEYS: dict[str, PluginKind] = {
    "attention.backend": PluginKind.ATTENTION,
    "scheduler.name": PluginKind.SCHEDULER,
    "loader.name": PluginKind.LOADER,
    "quantization.method": PluginKind.QUANTIZATION,
    "speculative.method": PluginKind.PROPOSER,
    "speculative.draft_load_format": PluginKind.LOADER,
    "parallel.executor": PluginKind.EXECUTOR,
    "structured_outputs.backend": PluginKind.STRUCTURED_OUTPUT,
    "kv_transfer.kv_connector": PluginKind.KV_CONNECTOR,
    "logits_processors": PluginKind.LOGITS_PROCESSOR,
}
# Values besides None that a key reads as unset: the builder takes `quantization.method or <checkpoint's>`.
_UNSET_VALUES: dict[str, tuple[Any, ...]] = {"quantization.method": ("",)}


def check_component_names(config: EngineConfig, pm: PluginManager | None = None, source: str = "config") -> None:
    """Raise ComponentNameError listing every key in COMPONENT_KEYS whose value no installed plugin registers.

    Names only, from discovery (which imports just the plugins' light registration modules): no component is
    loaded and no capability checked, so it is fast, never imports torch, and a file written for another
    machine (one with flash_attn installed, say) still validates here; what the names cannot use is the
    selector's to report when the engine is built.
    """
    problems = component_name_problems(config, pm)
    if problems:
        raise ComponentNameError(source, problems)


def component_name_problems(config: EngineConfig, pm: PluginManager | None = None) -> list[str]:
    """One line per unknown component name: the dotted key, then the selector's explanation of the value."""
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.selector import unknown_component_message

    pm = pm or get_plugin_manager()
    problems: list[str] = []
    for key, kind in COMPONENT_KEYS.items():
        names = [spec.name for spec in pm.components(kind)]
        for dotted, value in _named_values(config, key):
            if value is None or value in _UNSET_VALUES.get(key, ()) or value in names:
                continue
            problems.append(f"{dotted}: {unknown_component_message(pm, kind, str(value), names)}")
    return problems


def _named_values(config: EngineConfig, key: str) -> list[tuple[str, Any]]:
    """(dotted key, value) for the component name(s) `key` holds: `logits_processors[1]` per list item."""
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    if isinstance(node, list):
        return [(f"{key}[{i}]", item) for i, item in enumerate(node)]
    return [(key, node)]
