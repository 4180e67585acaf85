"""Reaching components the way the engine does: through the plugin manager, by kind and registered name.

The kit never imports a plugin's module by its path: a plugin's files may move (or be packaged differently)
while its registered name stays, and the engine itself only ever knows the name.
"""

from __future__ import annotations

import itertools
import unittest
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager
    from pagedllm.plugin_spec import ComponentSpec, PluginKind


class NotApplicable(unittest.SkipTest):
    """The component cannot run here (its registration check refused every case): not a failure.

    A `unittest.SkipTest`, so pytest and unittest report the calling test as skipped, with the reasons.
    """


def manager_or_default(pm: PluginManager | None = None) -> PluginManager:
    """`pm`, or the process-wide manager the engine uses by default."""
    if pm is not None:
        return pm
    from pagedllm.plugin_manager import get_plugin_manager

    return get_plugin_manager()


def find_spec(kind: PluginKind, name: str, pm: PluginManager | None = None) -> ComponentSpec:
    """The registration of `name`; AssertionError listing what is registered when there is none."""
    manager = manager_or_default(pm)
    spec = manager.get(kind, name)
    if spec is None:
        names = ", ".join(sorted(c.name for c in manager.components(kind))) or "none"
        broken = "".join(f"; plugin '{r.name}' is {r.status}: {r.error}" for r in manager.broken())
        raise AssertionError(
            f"no {kind.value} named {name!r} is registered (registered: {names}){broken}; is the package "
            "that provides it installed (pip install -e .) so its entry point is visible?"
        )
    return spec


def resolve(kind: PluginKind, name: str, pm: PluginManager | None = None) -> Any:
    """Import and return the registered component (what its `load()` gives: a class, usually)."""
    return find_spec(kind, name, pm).resolve()


_counter = itertools.count()


@contextmanager
def temporary_component(
    kind: PluginKind,
    name: str,
    load: Callable[[], Any],
    *,
    plugin_manager: PluginManager | None = None,
    **meta: Any,
) -> Iterator[ComponentSpec]:
    """Register `load` as component `name` of `kind` for the duration of the block, then withdraw it.

    For components not (yet) packaged with an entry point, and for the kit's own tests that feed it broken
    components. `meta` goes to the registration as a plugin's `register(...)` call would pass it.
    """
    from pagedllm import hookimpl

    manager = manager_or_default(plugin_manager)
    plugin_name = f"pagedllm-testing-{kind.value}-{name}-{next(_counter)}"

    def register_hook(register: Any) -> None:
        register(name, load, **meta)

    plugin = _Plugin()
    setattr(plugin, kind.hook_name, hookimpl(register_hook))
    manager.register(plugin, plugin_name, distribution="pagedllm.testing")
    try:
        spec = manager.get(kind, name)
        if spec is None or spec.plugin != plugin_name:
            raise AssertionError(f"could not register {kind.value} {name!r}: {manager.broken()}")
        yield spec
    finally:
        manager.unregister(plugin_name)


class _Plugin:
    """A bare object to hang one pluggy hookimpl on (hashable by identity, as pluggy needs)."""
