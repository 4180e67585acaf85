"""Which structured-output backend serves a request, and the frontend's check that it can.

Per request (vLLM picks per engine; a per-request choice lets one engine serve a Lark grammar through
llguidance and JSON schemas through xgrammar): `params.backend`, else the config's
`structured_outputs.backend`, is validated strictly by the selector; without either, the highest-priority
backend whose check passes wins, and every other one is kept with its reasons (Selection.explain()).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.selector import Selection, SelectionError, select
from pagedllm.structured_output.constraints import constraint_key, keyed_constraint

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


def select_backend(pm: PluginManager, params: StructuredOutputsParams, default: str | None = None) -> Selection:
    """The backend for `params`; SelectionError (a RuntimeError) lists every backend's reasons."""
    requested = params.backend or default
    by = "structured_outputs.backend" if params.backend else "config structured_outputs.backend"
    return select(pm, PluginKind.STRUCTURED_OUTPUT, params, requested=requested, requested_by=by)


def validate_structured_outputs(pm: PluginManager, params: StructuredOutputsParams,
                                default: str | None = None) -> str:
    """Select a backend and let it validate `params` (no tokenizer, in the frontend); returns its name.

    Raises ValueError with the field named: no backend can serve it (a missing package is named in the
    reasons: "package providing 'xgrammar' is not installed"), or the chosen backend refuses it.
    """
    try:
        selection = select_backend(pm, params, default)
    except SelectionError as exc:
        raise ValueError(f"structured_outputs: no backend can serve this {params.kind} constraint: {exc}") from None
    selection.load().validate(params)
    return selection.winner.name


def structured_outputs_check(
    pm: PluginManager, config: EngineConfig
) -> Callable[[StructuredOutputsParams], StructuredOutputsParams]:
    """The frontends' request-building check, bound to the engine's plugins and its `structured_outputs`
    section: returns the constraint the engine runs (the config's engine-wide options applied; one keyed copy,
    constraints.keyed_constraint, shared by every request of the same constraint), or raises."""
    section = config.structured_outputs
    passed = KeyCache()

    def check(params: StructuredOutputsParams) -> StructuredOutputsParams:
        if section.disable_any_whitespace and not params.disable_any_whitespace:
            params = dataclasses.replace(params, disable_any_whitespace=True)
        key = selection_key(params)
        if key is None:
            validate_structured_outputs(pm, params, section.backend)
            return params
        checked = passed.get(key)
        if checked is None:
            validate_structured_outputs(pm, params, section.backend)
            checked = keyed_constraint(params)
            passed.put(key, checked)
        return checked

    return check


def selection_key(params: StructuredOutputsParams) -> tuple[Any, ...] | None:
    """What a backend's selection and validation depend on: the requested backend and the constraint with
    its options (None for a constraint that has no key, e.g. a schema JSON cannot write: it is checked anew).

    NOTE: checking a constraint parses it, and xgrammar's check builds its grammar: ~1 ms a JSON schema on
    the CPU machine, once in the frontend and once more where the engine picks the backend to compile with.
    Agents send the same few schemas (their tools', their output type) with request after request, and 256
    concurrent requests of one schema spent ~0.3 s of a 3 s run in these checks before the first step on the
    H200 host. A constraint that passed is remembered by this key, and a failed one is checked again (its
    error is raised afresh each time)."""
    try:
        return (params.backend, *constraint_key(params))
    except (TypeError, ValueError):
        return None


class KeyCache:
    """A bounded map, least recently used out first; safe to share between the frontend's threads."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
