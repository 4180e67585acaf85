"""Which structured-output backend serves a request, and the frontend's check that it can.

Per request (vLLM picks per engine; a per-request choice lets one engine serve a Lark grammar through
llguidance and JSON schemas through xgrammar): `params.backend`, else the config's
`structured_outputs.backend`, is validated strictly by the selector; without either, the highest-priority
backend whose check passes wins, and every other one is kept with its reasons (Selection.explain()).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import PluginKind
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.selector import Selection, SelectionError, select

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
    section: returns the constraint the engine runs (the config's engine-wide options applied), or raises."""
    section = config.structured_outputs

    def check(params: StructuredOutputsParams) -> StructuredOutputsParams:
        if section.disable_any_whitespace and not params.disable_any_whitespace:
            params = dataclasses.replace(params, disable_any_whitespace=True)
        validate_structured_outputs(pm, params, section.backend)
        return params

    return check
