"""Benchmark reports: the machine, summary statistics, a printed table and JSON (the figures: plots.py)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

# One engine's result row: metric name -> value, or {"skipped": reason} when the engine did not run.
Result = dict[str, Any]

OURS = "pagedllm"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict[str, Any]:
    """Where and when the numbers were taken, with the library versions that produced them."""
    from importlib import metadata

    versions: dict[str, str] = {"python": platform.python_version()}
    # Installed distributions, read without importing them (llama.cpp only ever loads in a child process).
    for dist in ("pagedllm", "torch", "transformers", "accelerate", "llama-cpp-python", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "cpu_features": cpu_feature_info(),
        "versions": versions,
    }


def cpu_feature_info() -> dict[str, Any]:
    """The processor's instruction-set flags as the engine read them (its CPU defaults follow from these:
    a bf16 matmul is 4-5x faster with AMX or AVX512-BF16), so a report says which kernels could run."""
    from pagedllm.api.engine import cpu_features

    f = cpu_features()
    return {
        "summary": f.summary(),
        "amx_bf16": f.amx_bf16,
        "avx512_bf16": f.avx512_bf16,
        "avx512f": f.avx512f,
        "avx2": f.avx2,
        "physical_cores": f.physical_cores,
        "logical_cpus": f.logical_cpus,
        "flags": sorted(f.flags),
    }


def header(benchmark: str, engine: dict[str, Any], threads: int, load_before: list[float]) -> dict[str, Any]:
    """The report's opening: what ran, how it was invoked, on which machine, under what load."""
    return {
        "benchmark": benchmark,
        # The process's own argv (under pytest that is pytest's, since main() was handed its argv).
        "command": " ".join([os.path.basename(sys.argv[0]), *map(shlex.quote, sys.argv[1:])]) if sys.argv else "",
        "machine": machine_info(threads),
        "load_average_before": load_before,
        "engine": engine,
    }


def gaps(times: Sequence[float]) -> list[float]:
    """Differences of consecutive timestamps (inter-token latencies)."""
    return [b - a for a, b in itertools.pairwise(times)]


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90)) -> dict[str, float]:
    """{"p50": .., "p90": .., "mean": ..} of `values` (empty input gives an empty dict)."""
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    out = {f"p{q}": float(np.percentile(arr, q)) for q in qs}
    out["mean"] = float(arr.mean())
    return out


def latency_result(
    ttfts: list[float], itls: list[float], e2e: list[float], batch: int, input_len: int, output_len: int
) -> Result:
    """The latency row shared by every engine: milliseconds, p50/p90, and the resulting tok/s."""
    ttft = percentiles([t * 1e3 for t in ttfts])
    itl = percentiles([t * 1e3 for t in itls])
    lat = percentiles([t * 1e3 for t in e2e])
    mean_e2e = sum(e2e) / len(e2e)
    return {
        "ttft_ms_p50": ttft.get("p50"),
        "ttft_ms_p90": ttft.get("p90"),
        "tpot_ms_p50": itl.get("p50"),
        "tpot_ms_p90": itl.get("p90"),
        "tpot_ms_mean": itl.get("mean"),
        "e2e_ms_p50": lat.get("p50"),
        # Per stream: tokens after the first over the decode time; overall: all tokens over wall time.
        "decode_tok_per_s": 1e3 / itl["mean"] if itl else None,
        "prefill_tok_per_s": batch * input_len / (ttft["mean"] / 1e3),  # the batch's prompts over its TTFT
        "output_tok_per_s": batch * output_len / mean_e2e,
        "num_iters": len(e2e),
        # Raw times for --plot (plots.py), every engine's alike; popped before the JSON is written.
        "_samples": {"ttft_ms": [t * 1e3 for t in ttfts], "itl_ms": [t * 1e3 for t in itls]},
    }


def ratios(
    results: dict[str, Result], keys: Sequence[str], lower_better: Sequence[str] = ()
) -> dict[str, dict[str, float]]:
    """How many times faster we are than each baseline: >1 means pagedllm wins.

    For higher-is-better `keys` (tok/s) that is ours / baseline; for `lower_better` ones (milliseconds) it is
    baseline / ours, reported under "<key>_speedup".
    """
    ours = results.get(OURS, {})

    def num(row: Result, k: str) -> float | None:
        v = row.get(k)
        return float(v) if isinstance(v, (int, float)) and v > 0 else None

    out: dict[str, dict[str, float]] = {}
    for name, res in results.items():
        if name == OURS or "skipped" in res:
            continue
        row: dict[str, float] = {}
        for k in keys:
            a, b = num(ours, k), num(res, k)
            if a is not None and b is not None:
                row[k] = round(a / b, 3)
        for k in lower_better:
            a, b = num(ours, k), num(res, k)
            if a is not None and b is not None:
                row[f"{k}_speedup"] = round(b / a, 3)
        if row:
            out[f"{OURS}/{name}"] = row
    return out


def print_table(title: str, results: dict[str, Result], columns: Sequence[tuple[str, str]]) -> None:
    """A fixed-width table, one row per engine; `columns` are (result key, header) pairs."""
    name_w = max(len(n) for n in results) + 2
    headers = [h for _, h in columns]
    widths = [max(len(h), 10) for h in headers]
    print(f"\n{title}")
    print("engine".ljust(name_w) + "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for name, res in results.items():
        if "skipped" in res:
            print(name.ljust(name_w) + f"skipped: {res['skipped']}")
            continue
        cells = []
        for (key, _), w in zip(columns, widths, strict=True):
            v = res.get(key)
            cells.append((f"{v:,.2f}" if isinstance(v, float) else str(v if v is not None else "-")).rjust(w))
        print(name.ljust(name_w) + "  ".join(cells))


def print_weights(results: dict[str, Result]) -> None:
    """Which weights each engine ran, where it says (a GGUF dequantized for vLLM is not the file ours read)."""
    for name, res in results.items():
        if "weights" in res:
            print(f"{name} weights: {res['weights']}")


def print_ratios(rows: dict[str, dict[str, float]]) -> None:
    for name, row in rows.items():
        print(f"{name}: " + ", ".join(f"{k} x{v:.2f}" for k, v in row.items()))


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write the report; the folder is created when missing."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    print(f"wrote {path}")
