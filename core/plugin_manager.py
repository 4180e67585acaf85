"""Finds plugins through package entry points, loads each once, and collects what they register.

Failure policy (STYLE.md): a plugin that fails to import or register is skipped with a warning and shown as
broken by `pagedllm plugins`; when the config explicitly asks for one of its components, the selector raises
with the plugin and distribution named. A plugin whose `PAGEDLLM_PLUGIN_API` range excludes
`pagedllm.API_VERSION` (integer clauses compare its major, `PLUGIN_API_VERSION`) is imported (to read the
declaration) but never registered: it is skipped with a warning naming both versions and shown as
"incompatible". `PAGEDLLM_PLUGINS` (comma-separated entry-point or distribution names) is an allow-list for
third-party plugins; pagedllm's own plugins always load.

Duplicate names (docs/plugins/README.md, "Name clashes"): plugins register in a fixed order — pagedllm's own
first, then third-party entry points sorted by (distribution name, group, entry-point name), never by
sys.path order — and the first registration of a (kind, name) keeps it. A later one must pass
`override=True` to replace it; without it the later plugin is marked broken with both distributions named
(its other components are withdrawn too, so a half-registered plugin never serves). Two overrides of one
name: the later in that order wins.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from pagedllm import API_VERSION, hookspecs
from pagedllm.plugin_api import incompatibility
from pagedllm.plugin_spec import ComponentSpec, PluginKind, PluginLoadError

ALLOWLIST_ENV = "PAGEDLLM_PLUGINS"
OWN_DISTRIBUTION = "pagedllm"
DIRECT = "<direct>"  # the `group` of plugins registered with PluginManager.register()


@dataclass
class PluginRecord:
    """One entry point (or programmatically registered object) and what became of it."""

    name: str
    group: str
    value: str
    distribution: str
    version: str
    status: str  # "loaded", "broken", "blocked", "incompatible"
    error: str = ""


class PluginManager:
    def __init__(self) -> None:
        self._pm = pluggy.PluginManager("pagedllm")
        self._pm.add_hookspecs(hookspecs)
        # Re-entrant: a plugin that asks for the manager while being imported gets the partial state, not a hang.
        self._lock = threading.RLock()
        self._discovered = False
        self.records: list[PluginRecord] = []
        self._components: dict[PluginKind, dict[str, ComponentSpec]] = {k: {} for k in PluginKind}
        self._plugin_dist: dict[str, tuple[str, str]] = {}
        self._alias: dict[str, str] = {}  # plugin name of a module's second entry point -> its registered name

    @property
    def hook(self) -> Any:
        """Lifecycle hooks: `pm.hook.engine_started(engine=...)` etc."""
        self.discover()
        return self._pm.hook

    def discover(self, entry_points: Callable[[str], list[Any]] | None = None) -> None:
        """Load every entry point of every kind's group, once per manager."""
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            find = entry_points or _entry_points
            allowed = _allowlist()
            for kind in PluginKind:
                # NOTE: pagedllm's own plugins register first, whatever the sys.path order, so a third-party
                # component reusing an in-tree name is the duplicate (it must pass override=True to replace);
                # third-party ones follow in name order, so which of two clashing plugins wins never depends
                # on where pip put them.
                eps = sorted(find(kind.entry_point_group), key=_load_order)
                for ep in eps:
                    self._load_entry_point(kind, ep, allowed)
            self._pm.check_pending()
            self._collect()

    def register(self, plugin: object, name: str, distribution: str = "", version: str = "") -> None:
        """Register a plugin object directly (tests, embedding applications)."""
        self.discover()
        with self._lock:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
            self._plugin_dist[name] = (distribution or "<in-process>", version)
            self.records.append(
                PluginRecord(name, DIRECT, repr(plugin), distribution or "<in-process>", version, "loaded")
            )
            self._collect()

    def unregister(self, name: str) -> None:
        with self._lock:
            self._pm.unregister(name=name)
            self.records = [r for r in self.records if not (r.group == DIRECT and r.name == name)]
            self._collect()

    def components(self, kind: PluginKind) -> list[ComponentSpec]:
        self.discover()
        return list(self._components[kind].values())

    def get(self, kind: PluginKind, name: str) -> ComponentSpec | None:
        self.discover()
        return self._components[kind].get(name)

    def broken(self) -> list[PluginRecord]:
        """Plugins that failed to import or register, or declare an incompatible plugin API."""
        self.discover()
        return [r for r in self.records if r.status in ("broken", "incompatible")]

    def config_models(self) -> dict[str, Any]:
        """Component name -> the pydantic model its plugin registered for `plugins.<name>` (`config_model=`)."""
        self.discover()
        models: dict[str, Any] = {}
        for kind in PluginKind:
            for spec in self._components[kind].values():
                model = spec.meta.get("config_model")
                if model is not None:
                    models.setdefault(spec.name, model)
        return models

    def load_config(self, config: Any) -> dict[str, Any]:
        """Validate the config's plugin sections, then fire `config_loaded`; returns name -> validated section.

        Called once per engine by whoever builds one (LLMEngine, the server's engine-core process).
        """
        from pagedllm.config import validate_plugin_sections

        sections = validate_plugin_sections(config, self.config_models())
        self.hook.config_loaded(config=config)
        return sections

    # -- internals ---------------------------------------------------------------------------------------

    def _load_entry_point(self, kind: PluginKind, ep: Any, allowed: set[str] | None) -> None:
        dist_name, version = _dist_of(ep)
        record = PluginRecord(ep.name, ep.group, ep.value, dist_name, version, "loaded")
        plugin_name = _plugin_name(record)
        self.records.append(record)
        if (
            allowed is not None
            and dist_name != OWN_DISTRIBUTION
            and not ({ep.name, _normalize(dist_name)} & allowed)
        ):
            record.status = "blocked"
            record.error = f"not in {ALLOWLIST_ENV}"
            return
        if self._pm.has_plugin(plugin_name):
            return
        try:
            module = ep.load()
            why = incompatibility(module, API_VERSION)
            if why is not None:
                record.status = "incompatible"
                record.error = why
                warnings.warn(
                    f"pagedllm plugin '{ep.name}' ({ep.value}) from distribution {dist_name} {version} is "
                    f"skipped: it {why}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            # One module may be listed under several groups (a package offering a scheduler and an attention
            # backend); pluggy takes each object once, and its hooks already cover every kind.
            if self._pm.is_registered(module):
                self._alias[plugin_name] = self._pm.get_name(module) or plugin_name
            else:
                self._pm.register(module, name=plugin_name)
        except Exception as exc:
            record.status = "broken"
            record.error = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"pagedllm plugin '{ep.name}' ({ep.value}) from distribution {dist_name} {version} "
                f"failed to load and is skipped: {record.error}",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self._plugin_dist[plugin_name] = (dist_name, version)

    def _collect(self) -> None:
        """Ask every plugin to register its components, attributing each registration to its plugin.

        A plugin whose registration hook raises is marked broken and unregistered, and collection starts over
        without it: nothing it registered before failing stays selectable, and a later plugin reusing one of
        its names is not mistaken for a duplicate.
        """
        while True:
            components, failure = self._collect_once()
            if failure is None:
                self._components = components
                return
            plugin_name, error = failure
            self._pm.unregister(name=plugin_name)
            self._mark_broken(plugin_name, error)

    def _collect_once(self) -> tuple[dict[PluginKind, dict[str, ComponentSpec]], tuple[str, str] | None]:
        components: dict[PluginKind, dict[str, ComponentSpec]] = {k: {} for k in PluginKind}
        for kind in PluginKind:
            hook = getattr(self._pm.hook, kind.hook_name)
            # get_hookimpls() is in registration order (entry-point order); pluggy's LIFO call order is not used.
            for impl in hook.get_hookimpls():
                dist, version = self._plugin_dist.get(impl.plugin_name, ("?", ""))
                register = _Registrar(kind, impl.plugin_name, dist, version, components[kind])
                try:
                    impl.function(register=register)
                except Exception as exc:
                    return components, (impl.plugin_name, f"{kind.hook_name} raised {type(exc).__name__}: {exc}")
        return components, None

    def _mark_broken(self, plugin_name: str, error: str) -> None:
        for record in self.records:
            name = _plugin_name(record)
            if plugin_name in (name, self._alias.get(name)):
                record.status = "broken"
                record.error = error
        warnings.warn(f"pagedllm plugin '{plugin_name}' is broken and skipped: {error}", RuntimeWarning, stacklevel=3)


class _Registrar:
    """The `register(...)` callable handed to one plugin's registration hook.

    Its signature is what the `Register*` protocols of pagedllm.hookspecs type per kind (the keyword arguments
    they name past `description` arrive here in `meta`).
    """

    def __init__(
        self, kind: PluginKind, plugin: str, dist: str, version: str, into: dict[str, ComponentSpec]
    ) -> None:
        self.kind, self.plugin, self.dist, self.version, self.into = kind, plugin, dist, version, into

    def __call__(
        self,
        name: str,
        load: Callable[[], Any],
        *,
        priority: int = 0,
        requires: tuple[str, ...] | list[str] = (),
        check: Callable[[Any], list[str]] | None = None,
        description: str = "",
        **meta: Any,
    ) -> None:
        existing = self.into.get(name)
        if existing is not None and not meta.get("override", False):
            raise PluginLoadError(
                f"{self.kind.value} '{name}' is registered twice: by {existing.plugin} "
                f"({existing.distribution}) and by {self.plugin} ({self.dist}); pass override=True to replace"
            )
        self.into[name] = ComponentSpec(
            kind=self.kind,
            name=name,
            load=load,
            priority=priority,
            requires=tuple(requires),
            check=check,
            description=description,
            meta=meta,
            plugin=self.plugin,
            distribution=self.dist,
            version=self.version,
        )


def _entry_points(group: str) -> list[Any]:
    return list(importlib.metadata.entry_points(group=group))


def _dist_of(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", ""
    return dist.metadata["Name"] or "?", dist.version or ""


def _load_order(ep: Any) -> tuple[bool, str, str, str]:
    dist = _dist_of(ep)[0]
    return dist != OWN_DISTRIBUTION, _normalize(dist), str(ep.group), str(ep.name)


def _plugin_name(record: PluginRecord) -> str:
    """The name a record's plugin is registered under in pluggy."""
    return record.name if record.group == DIRECT else f"{record.group}:{record.name}"


def _normalize(name: str) -> str:
    """PEP 503 name normalization: `Pagedllm_Foo.bar` and `pagedllm-foo-bar` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _allowlist() -> set[str] | None:
    """Entry-point names and (normalized) distribution names allowed; None when the variable is unset."""
    raw = os.environ.get(ALLOWLIST_ENV)
    if raw is None:
        return None
    items = {item.strip() for item in raw.split(",") if item.strip()}
    return items | {_normalize(item) for item in items}


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager; plugins are discovered on first use, once."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
    _default.discover()
    return _default
