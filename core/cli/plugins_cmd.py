"""`pagedllm plugins`: every plugin and component, where it came from, and whether it can be used here.

Fast and CPU-safe: nothing here imports a component's implementation, only the light registration modules.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list plugins, their distributions and availability")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _attention_context() -> Any:
    """The machine's facts for the availability column, without importing torch when it is absent."""
    import importlib.util

    from pagedllm.selection_context import AttentionSelectionContext

    device, cc = "cpu", None
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            device, cc = "cuda", torch.cuda.get_device_capability()
    return AttentionSelectionContext(device, cc, "float32" if device == "cpu" else "bfloat16", "auto", 64, 16)


def collect() -> dict[str, Any]:
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind

    pm = get_plugin_manager()
    attn_ctx = _attention_context()
    components = []
    for kind in PluginKind:
        for spec in pm.components(kind):
            if kind is PluginKind.ATTENTION:
                reasons = spec.reasons_against(attn_ctx)
            else:
                # Other kinds are checked against a concrete model or config at build time.
                reasons = spec.missing_requirements()
            components.append(
                {
                    "kind": kind.value,
                    "name": spec.name,
                    "distribution": spec.distribution,
                    "version": spec.version,
                    "plugin": spec.plugin,
                    "priority": spec.priority,
                    "available": not reasons,
                    "reasons": reasons,
                    "description": spec.description,
                }
            )
    plugins = [
        {"name": r.name, "group": r.group, "module": r.value, "distribution": r.distribution,
         "version": r.version, "status": r.status, "error": r.error}
        for r in pm.records
    ]
    return {"machine": {"device": attn_ctx.device_type, "compute_capability": attn_ctx.compute_capability},
            "components": components, "plugins": plugins}


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"machine: {data['machine']['device']}"
          + (f" (compute capability {data['machine']['compute_capability']})" if data["machine"]["compute_capability"] else ""))
    print(f"{'KIND':<18} {'NAME':<20} {'DISTRIBUTION':<24} {'PRIO':>5}  AVAILABLE")
    for c in data["components"]:
        avail = "yes" if c["available"] else "no: " + "; ".join(c["reasons"])
        dist = f"{c['distribution']} {c['version']}".strip()
        print(f"{c['kind']:<18} {c['name']:<20} {dist:<24} {c['priority']:>5}  {avail}")
    bad = [p for p in data["plugins"] if p["status"] != "loaded"]
    if bad:
        print("\nplugins not loaded:")
        for p in bad:
            print(f"  {p['name']} ({p['module']}) from {p['distribution']} {p['version']}: {p['status']}: {p['error']}")
    return 0
