"""The `pagedllm top` screen: queues, the KV cache, throughput and latency distributions from two scrapes.

Rates and the latency columns cover the interval between the last two scrapes when requests finished in it
(the header says "last N s"); otherwise, and with --once, everything since the server started.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.plugins.commands.top.scrape import Histogram, Snapshot

# (row label, histogram name, unit scale, unit)
LATENCIES = (
    ("TTFT", "time_to_first_token_seconds", 1e3, "ms"),
    ("inter-token", "inter_token_latency_seconds", 1e3, "ms"),
    ("per output token", "request_time_per_output_token_seconds", 1e3, "ms"),
    ("queue", "request_queue_time_seconds", 1e3, "ms"),
    ("prefill", "request_prefill_time_seconds", 1e3, "ms"),
    ("decode", "request_decode_time_seconds", 1e3, "ms"),
    ("end-to-end", "e2e_request_latency_seconds", 1e3, "ms"),
)
SIZES = (
    ("prompt tokens", "request_prompt_tokens"),
    ("generated tokens", "request_generation_tokens"),
    ("tokens per step", "iteration_tokens_total"),
)
BAR_WIDTH = 30


def _window(snap: Snapshot, previous: Snapshot | None, name: str) -> Histogram:
    h = snap.histograms.get(name, Histogram())
    if previous is None:
        return h
    recent = h.minus(previous.histograms.get(name))
    return recent if recent.count else h


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def _bar(fraction: float) -> str:
    filled = max(0, min(BAR_WIDTH, round(fraction * BAR_WIDTH)))
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def _label(snap: Snapshot, name: str, key: str) -> str | None:
    for labels, _ in snap.labelled.get(name, []):
        if key in labels:
            return labels[key]
    return None


def render(snap: Snapshot, previous: Snapshot | None, url: str) -> list[str]:
    """The screen as lines (no escape codes: the caller clears and redraws)."""
    model = _label(snap, "num_requests_running", "model_name") or "?"
    healthy = snap.value("engine_healthy", 1.0) >= 1.0
    restarts = int(snap.value("engine_core_restarts"))
    clock = time.strftime("%H:%M:%S")
    lines = [f"pagedllm top  {url}  model {model}  engine {'up' if healthy else 'DOWN'}"
             f" (restarts {restarts})  {clock}", ""]
    finished = {labels.get("finished_reason", "?"): v for labels, v in snap.labelled.get("request_success", [])}
    done = ", ".join(f"{k} {int(v)}" for k, v in sorted(finished.items()) if v) or "none"
    lines.append(f"requests   running {int(snap.value('num_requests_running')):>4}   waiting "
                 f"{int(snap.value('num_requests_waiting')):>4}   finished {int(sum(finished.values()))} ({done})"
                 f"   preemptions {int(snap.value('num_preemptions'))}")
    usage = snap.value("kv_cache_usage_perc")
    blocks = _label(snap, "cache_config_info", "num_gpu_blocks")
    block_size = _label(snap, "cache_config_info", "block_size")
    pool = f"   {blocks} blocks x {block_size} tokens" if blocks and block_size else ""
    lines.append(f"KV cache   {_bar(usage)} {usage * 100:5.1f}% in use{pool}   prefix-cache hits "
                 f"{snap.value('prefix_cache_hit_rate') * 100:.1f}%")
    lines.append(_throughput(snap, previous))
    if snap.value("spec_decode_num_drafts"):
        lines.append(f"spec dec   acceptance {snap.value('spec_decode_acceptance_rate') * 100:.1f}%   mean accepted "
                     f"{snap.value('spec_decode_mean_accepted_length'):.2f} per draft")
    windowed = previous is not None and any(
        _window(snap, previous, name) is not snap.histograms.get(name) for _, name, _, _ in LATENCIES)
    span = f"last {snap.time - previous.time:.1f} s" if windowed and previous is not None else "since start"
    lines += ["", f"{'latency (' + span + ')':<28}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'count':>9}"]
    for label, name, scale, unit in LATENCIES:
        h = _window(snap, previous, name)
        lines.append(f"  {label + ' (' + unit + ')':<26}{_fmt(h.mean, scale):>10}{_fmt(h.quantile(0.5), scale):>10}"
                     f"{_fmt(h.quantile(0.9), scale):>10}{_fmt(h.quantile(0.99), scale):>10}{int(h.count):>9}")
    lines.append("")
    for label, name in SIZES:
        h = _window(snap, previous, name)
        lines.append(f"  {label:<26}{_fmt(h.mean):>10}{_fmt(h.quantile(0.5), digits=0):>10}"
                     f"{_fmt(h.quantile(0.9), digits=0):>10}{_fmt(h.quantile(0.99), digits=0):>10}{int(h.count):>9}")
    lines += ["", "percentiles are estimated inside histogram buckets (as histogram_quantile does); means are exact"]
    return lines


def _throughput(snap: Snapshot, previous: Snapshot | None) -> str:
    prompt, generated = snap.value("prompt_tokens"), snap.value("generation_tokens")
    if previous is None or snap.time <= previous.time:
        return f"tokens     prompt {int(prompt):,}   generated {int(generated):,}   (totals; rates need two scrapes)"
    dt = snap.time - previous.time
    return (f"tokens/s   prompt {(prompt - previous.value('prompt_tokens')) / dt:10,.1f}   generated "
            f"{(generated - previous.value('generation_tokens')) / dt:10,.1f}   (last {dt:.1f} s)")


def summary(snap: Snapshot, previous: Snapshot | None) -> dict[str, Any]:
    """The same figures as plain numbers (`--once --json`); latencies in seconds."""
    out: dict[str, Any] = {
        "model": _label(snap, "num_requests_running", "model_name"),
        "engine_healthy": snap.value("engine_healthy", 1.0) >= 1.0,
        "requests_running": snap.value("num_requests_running"),
        "requests_waiting": snap.value("num_requests_waiting"),
        "requests_finished": snap.value("request_success"),
        "preemptions": snap.value("num_preemptions"),
        "kv_cache_usage": snap.value("kv_cache_usage_perc"),
        "prefix_cache_hit_rate": snap.value("prefix_cache_hit_rate"),
        "prompt_tokens": snap.value("prompt_tokens"),
        "generation_tokens": snap.value("generation_tokens"),
        "num_gpu_blocks": _label(snap, "cache_config_info", "num_gpu_blocks"),
        "block_size": _label(snap, "cache_config_info", "block_size"),
    }
    for _, name, _, _ in LATENCIES:
        h = _window(snap, previous, name)
        out[name] = {"count": h.count, "mean": h.mean, "p50": h.quantile(0.5), "p90": h.quantile(0.9),
                     "p99": h.quantile(0.99)}
    for _, name in SIZES:
        h = _window(snap, previous, name)
        out[name] = {"count": h.count, "mean": h.mean, "p50": h.quantile(0.5), "p99": h.quantile(0.99)}
    return out
