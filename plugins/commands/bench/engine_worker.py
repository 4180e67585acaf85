"""Engines under test in their own processes, so each one's resident memory is its own.

`bench latency --compare-quantization none` runs our engine a second time with another quantization method
(e.g. the GGUF dequantized at load next to it kept quantized); `--rounds R` alternates every engine R times
on the same prompts. Each variant and llama.cpp live in a spawned child that loads once and serves every
round (`EngineWorker`), and every row reports the resident set of the process that ran it (`rss_fields`).

NOTE(1): RSS is VmRSS after the timed runs, and VmHWM the peak; for the in-process engine that process also
holds the tokenizer and the benchmark itself (for a child: the same, minus nothing), so compare rows, not
absolute figures across machines.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pagedllm.plugins.commands.bench.report import Result

_CACHE: dict[str, Any] = {}  # in the child: the engine (or llama.cpp) it loaded once


def rss_fields() -> dict[str, float]:
    """{"rss_mb": current resident set, "rss_peak_mb": its high-water mark} of this process (Linux)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_mb" if key == "VmRSS" else "rss_peak_mb"] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


class EngineWorker:
    """One spawned child that keeps what it loaded between calls (one engine or one llama.cpp)."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    def call(self, job: Any, *args: Any) -> Result:
        return self._pool.submit(job, *args).result()  # type: ignore[no-any-return]

    def close(self) -> None:
        self._pool.shutdown()


def variant_args(args: argparse.Namespace, quantization: str) -> argparse.Namespace:
    """The same command line with another quantization method (and no baselines of its own)."""
    out = copy.copy(args)
    out.quantization = quantization
    out.compare_hf = out.compare_llamacpp = out.compare_vllm = False
    out.compare_quantization = []
    return out


def ours_latency_job(
    args: argparse.Namespace, iterations: list[list[list[int]]], output_len: int, warm: list[list[int]] | None
) -> Result:
    """Child body: build our engine from `args` on the first call, then time `iterations` (latency.run_ours)."""
    from pagedllm.plugins.commands.bench.latency import run_ours
    from pagedllm.plugins.commands.bench.target import BenchTarget

    target = _CACHE.get("engine")
    if target is None:
        target = _CACHE["engine"] = BenchTarget.from_args(args)
    res = run_ours(target, iterations, output_len, warm)
    res.pop("_samples", None)
    res["quantization"] = args.quantization
    res.update(rss_fields())
    return res


def llamacpp_latency_job(
    gguf: str, threads: int, iterations: list[list[list[int]]], output_len: int, warmup: bool
) -> Result:
    """Child body: load llama.cpp on the first call, then time `iterations`."""
    from pagedllm.plugins.commands.bench.llamacpp_baseline import llamacpp_latency, load_llamacpp

    llama = _CACHE.get("llama")
    if llama is None:
        llama = _CACHE["llama"] = load_llamacpp(gguf, threads, len(iterations[0][0]) + output_len + 16)
    res = llamacpp_latency(llama, iterations, output_len, warmup)
    res.update(rss_fields())
    return res
