"""`bench --plot FILE`: the benchmark's figures, labelled so they read on their own (pip install "pagedllm[plot]").

    throughput   one panel per rate (output tok/s, total tok/s, requests/s): a bar per engine with its value,
                 and under each baseline how many times faster pagedllm is (the JSON report's ratios)
    latency      time to first token and inter-token latency as distributions (empirical CDFs, p50 / p90
                 marked, in the legend too), and each engine's decode tok/s per stream with the ratios
    serve        the load's time to first token, inter-token and end-to-end latency as distributions, with
                 the request and token rates it reached

Every figure's title says what ran (workload, model) and its footer where (CPU, threads, date) and which engines
were skipped and why. matplotlib is imported only here, only for --plot, and checked before the benchmark runs
(`require_matplotlib`), so a missing install costs no benchmark time.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pagedllm.plugins.commands.bench.report import OURS, Result

FORMATS = (".png", ".svg", ".pdf")
INSTALL_HINT = 'pip install "pagedllm[plot]"'
# One colour per engine, ours first, the same in every panel.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
THROUGHPUT_PANELS = (("output_tok_per_s", "output tokens / s"), ("total_tok_per_s", "total tokens / s"),
                     ("requests_per_s", "requests / s"))


class PlotError(RuntimeError):
    """--plot cannot be honoured: matplotlib is missing or the file type is not one it writes here."""


def require_matplotlib(path: str) -> Any:
    """pyplot on a file-only backend; PlotError naming the fix when it cannot be."""
    if os.path.splitext(path)[1].lower() not in FORMATS:
        raise PlotError(f"--plot {path}: the file must end in {', '.join(FORMATS)}")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return plt


def _colours(names: list[str]) -> dict[str, str]:
    return {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(names)}


def _footer(report: dict[str, Any], results: dict[str, Result]) -> str:
    m = report.get("machine", {})
    where = f"{m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, {m.get('date', '')}"
    skipped = [f"{name} skipped: {r['skipped']}" for name, r in results.items() if "skipped" in r]
    return "\n".join([where, *skipped])


def _model(report: dict[str, Any]) -> str:
    model = str(report.get("engine", {}).get("model") or "default model")
    return os.path.basename(model.rstrip("/")) or model


def _count(workload: dict[str, Any], key: str) -> str:
    value = workload.get(key)
    return f"{value:,}" if isinstance(value, int) else "?"


def _save(plt: Any, fig: Any, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def _ratio_text(ours: Any, theirs: Any, higher_better: bool = True) -> str:
    if not isinstance(ours, (int, float)) or not isinstance(theirs, (int, float)) or ours <= 0 or theirs <= 0:
        return ""
    ratio = ours / theirs if higher_better else theirs / ours
    return f"{OURS} is {ratio:.2f}x"


def _bars(ax: Any, results: dict[str, Result], key: str, label: str, colours: dict[str, str], fmt: str) -> None:
    """One bar per engine that ran, its value on top and the ratio to ours beneath the name."""
    names = [n for n, r in results.items() if isinstance(r.get(key), (int, float))]
    values = [float(results[n][key]) for n in names]
    bars = ax.bar(names, values, color=[colours[n] for n in names], width=0.6)
    for bar, value in zip(bars, values):
        ax.annotate(format(value, fmt), (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                    xytext=(0, 2), textcoords="offset points", fontsize=9)
    ours = results.get(OURS, {}).get(key)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n if n == OURS else f"{n}\n{_ratio_text(ours, results[n][key])}" for n in names],
                       fontsize=9)
    ax.set_title(label, fontsize=10)
    ax.set_ylabel(label)
    ax.set_ylim(0, max(values, default=1.0) * 1.18 or 1.0)  # room for the value labels
    ax.grid(axis="y", alpha=0.3)


def plot_throughput(path: str, report: dict[str, Any]) -> None:
    """Write the throughput figure to `path`."""
    plt = require_matplotlib(path)
    _save(plt, throughput_figure(plt, report), path)


def throughput_figure(plt: Any, report: dict[str, Any]) -> Any:
    """The throughput report (throughput.py's JSON) as one bar panel per rate."""
    results: dict[str, Result] = report["results"]
    colours = _colours(list(results))
    panels = [(k, label) for k, label in THROUGHPUT_PANELS
              if any(isinstance(r.get(k), (int, float)) for r in results.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        _bars(ax, results, key, label, colours, ",.1f")
    w = report.get("workload", {})
    fig.suptitle(f"bench throughput: {_count(w, 'num_requests')} requests, {_count(w, 'prompt_tokens')} prompt + "
                 f"{_count(w, 'output_tokens')} output tokens, {_model(report)}", fontsize=11)
    fig.text(0.01, -0.02, _footer(report, results) + f"\nratios: how many times faster {OURS} is (higher is better)",
             fontsize=8, va="top", color="#444444")
    fig.tight_layout()
    return fig


def _cdf(ax: Any, samples: dict[str, dict[str, list[float]]], key: str, title: str, colours: dict[str, str],
         method: Literal["linear", "inverted_cdf"] = "linear") -> None:
    """Empirical CDFs of `key` per engine; p50 / p90 by numpy's `method`, the one the printed table used."""
    import numpy as np

    lows, highs = [], []
    for name, data in samples.items():
        values = np.sort(np.asarray(data.get(key, []), dtype=float))
        if not len(values):
            continue
        # The printed table's percentiles, dotted where the curve passes them.
        marks = np.percentile(values, [50, 90], method=method)
        fractions = np.arange(1, len(values) + 1) / len(values)
        ax.step(values, fractions, where="post", color=colours[name], linewidth=1.8,
                label=f"{name}: p50 {marks[0]:,.1f}, p90 {marks[1]:,.1f} ms (n={len(values)})")
        on_curve = np.searchsorted(values, marks, side="right") / len(values)
        ax.plot(marks, on_curve, "o", color=colours[name], markersize=5)
        lows.append(values[0])
        highs.append(values[-1])
    if lows and min(lows) > 0 and max(highs) / min(lows) > 50:
        ax.set_xscale("log")  # engines an order of magnitude apart stay readable side by side
    ax.axhline(0.5, color="#999999", linewidth=0.8, linestyle=":")
    ax.axhline(0.9, color="#999999", linewidth=0.8, linestyle=":")
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("fraction of samples <= x")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


def plot_latency(path: str, samples: dict[str, dict[str, list[float]]], report: dict[str, Any]) -> None:
    """Write the latency figure to `path`."""
    plt = require_matplotlib(path)
    _save(plt, latency_figure(plt, samples, report), path)


def latency_figure(plt: Any, samples: dict[str, dict[str, list[float]]], report: dict[str, Any]) -> Any:
    """The latency report (latency.py's JSON) plus its raw times: engine -> {"ttft_ms": [...], "itl_ms": [...]}."""
    results: dict[str, Result] = report["results"]
    colours = _colours(list(results))
    fig, axes = plt.subplots(1, 3, figsize=(15.0, 4.4), gridspec_kw={"width_ratios": [1.2, 1.2, 0.8]})
    _cdf(axes[0], samples, "ttft_ms", "time to first token (per request)", colours)
    _cdf(axes[1], samples, "itl_ms", "inter-token latency (per token)", colours)
    _bars(axes[2], results, "decode_tok_per_s", "decode tokens / s per stream", colours, ",.1f")
    w = report.get("workload", {})
    fig.suptitle(f"bench latency: batch {w.get('batch_size', '?')}, {w.get('input_len', '?')} prompt + "
                 f"{w.get('output_len', '?')} output tokens, {w.get('num_iters', '?')} iterations, {_model(report)}",
                 fontsize=11)
    fig.text(0.01, -0.02, _footer(report, results) + f"\nratios: how many times faster {OURS} is (higher is better);"
             " dots mark p50 and p90", fontsize=8, va="top", color="#444444")
    fig.tight_layout()
    return fig


def plot_serve(path: str, samples: dict[str, list[float]], summary: dict[str, Any]) -> None:
    """Write the serve-load figure to `path`."""
    plt = require_matplotlib(path)
    _save(plt, serve_figure(plt, samples, summary), path)


def serve_figure(plt: Any, samples: dict[str, list[float]], summary: dict[str, Any]) -> Any:
    """A `bench serve` run (serve_load.py's summary) and its raw times: {"ttft_ms", "itl_ms", "e2e_ms": [...]}."""
    cfg = summary.get("config", {})
    name = str(cfg.get("model") or "server")
    colours = {name: COLOURS[0]}
    fig, axes = plt.subplots(1, 3, figsize=(15.0, 4.4))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token (per request)"),
                           (axes[1], "itl_ms", "inter-token latency (per token)"),
                           (axes[2], "e2e_ms", "end-to-end latency (per request)")):
        # serve_load's table takes nearest-rank percentiles: numpy's inverted_cdf.
        _cdf(ax, {name: samples}, key, title, colours, method="inverted_cdf")
    rate = cfg.get("request_rate")
    rate_text = "all at once" if rate is None else f"{rate:g} req/s ({cfg.get('arrival', '?')})"
    fig.suptitle(f"bench serve: {cfg.get('num_prompts', '?')} requests, {rate_text}, {cfg.get('input_len', '?')} "
                 f"prompt words + {cfg.get('output_len', '?')} output tokens, {cfg.get('endpoint', '?')} at "
                 f"{cfg.get('base_url', '?')}", fontsize=11)
    fig.text(0.01, -0.02, f"completed {summary.get('completed', 0)}, failed {summary.get('failed', 0)} in "
             f"{summary.get('duration_s', 0.0):.2f} s: {summary.get('request_throughput', 0.0):.2f} req/s, "
             f"{summary.get('output_throughput', 0.0):,.1f} output tok/s; dots mark p50 and p90",
             fontsize=8, va="top", color="#444444")
    fig.tight_layout()
    return fig
