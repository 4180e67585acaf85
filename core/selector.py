"""Chooses a component per kind: capability checks, then priority. Every decision can explain itself."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.plugin_manager import PluginManager
from pagedllm.plugin_spec import ComponentSpec, PluginKind


class SelectionError(RuntimeError):
    """No component could serve the request; the message lists every candidate's reasons."""


@dataclass
class Selection:
    kind: PluginKind
    winner: ComponentSpec
    requested: str | None = None
    rejected: list[tuple[ComponentSpec, list[str]]] = field(default_factory=list)
    requested_by: str = "config"
    priority: int | None = None  # the winner's priority for this context (None: its fixed one)

    def explain(self) -> str:
        how = f"requested by {self.requested_by}" if self.requested else "highest priority that passed its checks"
        priority = self.winner.priority if self.priority is None else self.priority
        lines = [
            f"{self.kind.value}: {self.winner.name} ({how}; priority {priority}, "
            f"from {self.winner.distribution})"
        ]
        for spec, reasons in self.rejected:
            lines.append(f"  - {spec.name}: {'; '.join(reasons)}")
        return "\n".join(lines)

    def load(self) -> Any:
        return self.winner.resolve()


def select(
    pm: PluginManager,
    kind: PluginKind,
    context: Any,
    requested: str | None = None,
    candidates: Iterable[ComponentSpec] | None = None,
    requested_by: str = "config",
) -> Selection:
    """Pick the component of `kind` for `context`.

    An explicit `requested` name is validated strictly: unknown or unable → SelectionError naming why. Without
    one, candidates are walked by priority and the first with no reasons against it wins; the rest are kept
    with their reasons (a capable but lower-priority one is reported as such).
    """
    pool = list(candidates) if candidates is not None else pm.components(kind)
    if requested is not None:
        spec = next((c for c in pool if c.name == requested), None)
        if spec is None:
            raise SelectionError(unknown_component_message(pm, kind, requested, [c.name for c in pool]))
        reasons = spec.reasons_against(context)
        if reasons:
            raise SelectionError(
                f"{kind.value} '{requested}' (from {spec.distribution}) was requested but cannot be used: "
                + "; ".join(reasons)
            )
        others = [(c, ["not requested"]) for c in pool if c is not spec]
        return Selection(kind, spec, requested, others, requested_by)

    rejected: list[tuple[ComponentSpec, list[str]]] = []
    winner: ComponentSpec | None = None
    priority = {c.name: effective_priority(c, context) for c in pool}
    for spec in sorted(pool, key=lambda c: -priority[c.name]):
        if spec.meta.get("explicit_only"):
            rejected.append((spec, ["only used when asked for by name"]))
            continue
        reasons = spec.reasons_against(context)
        if reasons:
            rejected.append((spec, reasons))
        elif winner is None:
            winner = spec
        else:
            rejected.append((spec, [
                f"lower priority ({priority[spec.name]}) than {winner.name} ({priority[winner.name]})"
            ]))
    if winner is None:
        detail = "; ".join(f"{s.name}: {', '.join(r)}" for s, r in rejected) or "no candidates registered"
        raise SelectionError(f"no usable {kind.value} for {context!r}: {detail}")
    return Selection(kind, winner, None, rejected, priority=priority[winner.name])


def unknown_component_message(pm: PluginManager, kind: PluginKind, requested: str, names: Iterable[str]) -> str:
    """Why `requested` names no `kind`: the names there are, broken plugins that may have provided it, a close match.

    Shared with config validation (`pagedllm.component_names.check_component_names`), so a misspelled name reads the
    same whether `pagedllm config validate` or the engine build finds it.
    """
    available = sorted(names)
    hint = _broken_hint(pm, kind) or (
        f"; no installed plugin registers it (is the package that provides it installed? "
        f"`pagedllm plugins` lists every {kind.value})"
    )
    close = close_match(requested, available)
    # Last: everything before it ("...; available: fcfs; no installed plugin registers it") is quoted by docs
    # and matched by scripts, so the suggestion only ever adds to the end.
    suggestion = f"; did you mean '{close}'?" if close else ""
    return f"no {kind.value} named '{requested}'; available: {', '.join(available) or 'none'}{hint}{suggestion}"


def close_match(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate `name` most likely misspells (difflib's ratio >= 0.6), ignoring case; None when none is."""
    by_folded = {c.casefold(): c for c in candidates}
    found = difflib.get_close_matches(name.casefold(), list(by_folded), n=1)
    return by_folded[found[0]] if found else None


def effective_priority(spec: ComponentSpec, context: Any) -> int:
    """`spec`'s priority for `context`: its `priority_for(context)` when it registered one, else its fixed one.

    Attention backends rank differently per GPU generation (vLLM's order: FlashAttention before FlashInfer
    on Ampere/Hopper, FlashInfer first on Blackwell), so each backend may pass `priority_for=` with its
    registration; the policy stays with the plugin, not in a core table of names. A raising `priority_for`
    falls back to the fixed priority: ranking must never crash selection.
    """
    rank = spec.meta.get("priority_for")
    if rank is None:
        return spec.priority
    try:
        return int(rank(context))
    except Exception:
        return spec.priority


def _broken_hint(pm: PluginManager, kind: PluginKind) -> str:
    """Broken plugins that may have provided a requested component, with their distribution and error.

    A plugin that failed to import registered nothing, so its component names are unknown: every broken
    plugin listed in this kind's entry-point group, or whose hook for this kind raised, is named.
    """
    broken = [r for r in pm.broken() if r.group == kind.entry_point_group or kind.hook_name in r.error]
    return "".join(
        f"; plugin '{r.name}' ({r.value}) from distribution {r.distribution} {r.version} is {r.status}: {r.error}"
        for r in broken
    )
