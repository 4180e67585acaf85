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
    """The machine's facts for the availability column, without importing torch (seconds of start-up)."""
    from pagedllm.selection_context import AttentionSelectionContext

    cc = _cuda_capability()
    device = "cuda" if cc is not None else "cpu"
    return AttentionSelectionContext(device, cc, "float32" if device == "cpu" else "bfloat16", "auto", 64, 16)


def _cuda_capability() -> tuple[int, int] | None:
    """GPU 0's compute capability if torch can use CUDA here, else None; asks the driver, not torch."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:  # already paid for: ask it directly
        return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    if not _torch_built_with_cuda():
        return None
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, device, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    if cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76 (cuda.h)
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device) != 0:
        return None
    if cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device) != 0:
        return None
    return major.value, minor.value


def _torch_built_with_cuda() -> bool:
    """Read torch/version.py's `cuda = ...` line as text: a CPU-only build says None (no torch import)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return True  # unknown build: let the driver decide
    match = re.search(r"^cuda\b[^=]*=\s*(.+)$", text, re.MULTILINE)
    return match is None or match.group(1).strip() != "None"


def collect() -> dict[str, Any]:
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind
    from pagedllm.selector import effective_priority

    pm = get_plugin_manager()
    attn_ctx = _attention_context()
    components = []
    for kind in PluginKind:
        for spec in pm.components(kind):
            priority = spec.priority
            if kind is PluginKind.ATTENTION:
                reasons = spec.reasons_against(attn_ctx)
                priority = effective_priority(spec, attn_ctx)  # some rank per GPU generation
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
                    "priority": priority,
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
