"""`pagedllm bench throughput|latency|serve`: offline benchmarks against transformers, llama.cpp and vLLM baselines,
and a load generator for OpenAI-compatible servers.

The work lives in this package's other modules; this one only declares flags (it is what the command
registration's `load()` returns: `add_parser`), so `pagedllm --help` stays fast and never imports torch,
transformers or llama_cpp.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from pagedllm.api.cli import add_engine_args


def _add_common(p: argparse.ArgumentParser) -> None:
    """Flags shared by both benchmarks (the engine's own --seed also seeds the random prompts)."""
    g = p.add_argument_group("benchmark")
    g.add_argument("--json", dest="json_out", metavar="OUT", help="write the result as JSON to this file")
    g.add_argument("--compare-hf", action="store_true",
                   help="also run Hugging Face transformers' generate on the same weights and prompts")
    g.add_argument("--compare-llamacpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python) on the same GGUF and prompts")
    g.add_argument("--hf-dtype", default="float32", help="torch dtype for the transformers baseline")
    g.add_argument("--compare-vllm", action="store_true",
                   help="also run vLLM (its CPU build, in its own virtual environment) on the same weights and prompts")
    g.add_argument("--vllm-python", metavar="PATH",
                   help="the Python of vLLM's virtual environment (default: $PAGEDLLM_VLLM_PYTHON)")
    g.add_argument("--vllm-dtype", default="bfloat16", help="dtype vLLM computes in (a GGUF is dequantized to it)")
    g.add_argument("--vllm-timeout", type=float, default=1800.0, metavar="S",
                   help="give up on the vLLM baseline after this many seconds (its start-up compiles the model)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up pass (on by default)")
    g.add_argument("--warmup", dest="warmup", action="store_true", help="run an untimed warm-up pass (default)")
    p.set_defaults(warmup=True)


def add_parser(sub: Any) -> None:
    """Register `bench` with its `throughput` and `latency` subcommands on the top-level subparsers."""
    bench = sub.add_parser("bench", help="measure throughput or latency (optionally against HF / llama.cpp / vLLM)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    tp = bsub.add_parser("throughput", help="offline throughput over many requests")
    w = tp.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    w.add_argument("--input-len-range", metavar="LO:HI", help="uniform prompt length in [LO, HI] (overrides --input-len)")
    w.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    w.add_argument("--output-len-range", metavar="LO:HI", help="uniform output length in [LO, HI]")
    w.add_argument("--prompts-file", help="text prompts, one per line, instead of random token ids")
    w.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of the transformers baseline")
    w.add_argument("--hf-max-prompts", type=int, default=None,
                   help="run the transformers baseline on only the first N prompts (it is slow)")
    w.add_argument("--plot", metavar="PNG", help="figure of the rates per engine with ratios (.png, .svg or .pdf; needs pagedllm[plot])")
    _add_common(tp)
    add_engine_args(tp)
    tp.set_defaults(func=_run_throughput)

    lat = bsub.add_parser("latency", help="time to first token and per-token decode latency")
    w = lat.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=32)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--batch-size", type=int, default=1, help="requests decoded together (1 = single stream)")
    w.add_argument("--num-iters", type=int, default=3, help="timed repetitions")
    w.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, alternating, and report medians (shared machines)")
    w.add_argument("--compare-quantization", nargs="+", default=[], metavar="METHOD",
                   help="also run our engine with these quantization methods (e.g. none: a GGUF dequantized at "
                        "load), each in its own process so its RSS is its own")
    w.add_argument("--plot", metavar="PNG", help="TTFT and inter-token latency distributions, decode tok/s with ratios (.png, .svg or .pdf; "
                   "needs pagedllm[plot])")
    _add_common(lat)
    add_engine_args(lat)
    lat.set_defaults(func=_run_latency)

    # Light: serve_load imports neither torch nor httpx at import.
    from pagedllm.plugins.commands.bench.serve_load import add_serve_arguments

    srv = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (ours or another engine's)")
    add_serve_arguments(srv)
    srv.set_defaults(func=_run_serve)


def _run_throughput(args: argparse.Namespace) -> int:
    from pagedllm.plugins.commands.bench.throughput import run_throughput_cli

    return _reporting_workload_errors(run_throughput_cli, args)


def _run_serve(args: argparse.Namespace) -> int:
    from pagedllm.plugins.commands.bench.serve_load import run_serve_cli

    return _reporting_workload_errors(run_serve_cli, args)


def _run_latency(args: argparse.Namespace) -> int:
    from pagedllm.plugins.commands.bench.latency import run_latency_cli

    return _reporting_workload_errors(run_latency_cli, args)


def _reporting_workload_errors(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """A workload the engine cannot run is a usage error (exit 2 with the reason), not a traceback."""
    from pagedllm.plugins.commands.bench.plots import PlotError
    from pagedllm.plugins.commands.bench.workloads import WorkloadError

    try:
        return run(args)
    except (WorkloadError, PlotError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
