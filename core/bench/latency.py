"""`pagedllm bench latency`: time to first token and per-token decode latency for one fixed batch.

Each timed iteration decodes a batch of `--batch-size` prompts of exactly `--input-len` random ids for
exactly `--output-len` tokens. Every iteration gets fresh ids, so prefix caching cannot turn a later
iteration's prefill into a cache hit; all engines see the same ids.

    arrival ──prefill──▶ token 1 ──▶ token 2 ──▶ ... ──▶ token O
    |<────── TTFT ─────>|<- TPOT ->|
    e2e = TTFT + (O - 1) x mean TPOT;  output tok/s = B x O / e2e;  decode tok/s = 1 / mean TPOT (per stream);
    prefill tok/s = B x input_len / mean TTFT
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagedllm.bench import report
from pagedllm.bench.report import OURS, Result, gaps, latency_result
from pagedllm.bench.target import BenchTarget, kv_delta, load_average, thread_count
from pagedllm.bench.workloads import Workload, WorkloadError, allowed_token_ids, check_fits

_COLUMNS = [
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p90", "TTFT p90 ms"),
    ("tpot_ms_p50", "TPOT p50 ms"),
    ("tpot_ms_p90", "TPOT p90 ms"),
    ("prefill_tok_per_s", "prefill tok/s"),
    ("decode_tok_per_s", "decode tok/s"),
    ("output_tok_per_s", "out tok/s"),
]


def make_iterations(
    num_iters: int, batch: int, input_len: int, token_ids: np.ndarray, seed: int
) -> list[list[list[int]]]:
    """num_iters batches of `batch` prompts, each prompt `input_len` fresh random ids."""
    if min(num_iters, batch, input_len) < 1:
        raise WorkloadError("--num-iters, --batch-size and --input-len must all be >= 1")
    rng = np.random.default_rng(seed)
    return [[rng.choice(token_ids, size=input_len).tolist() for _ in range(batch)] for _ in range(num_iters)]


def run_ours(
    target: BenchTarget, iterations: list[list[list[int]]], output_len: int, warm: list[list[int]] | None
) -> Result:
    """Per-token times come from each request's RequestMetrics, stamped by the engine as tokens arrive.

    NOTE(1): the warm-up batch `warm` has its own ids, so it seeds nothing the timed batches could hit in
    the prefix cache.
    """
    if warm is not None:
        target.generate(Workload(warm, [min(8, output_len)] * len(warm), "warmup"))
    before = target.kv_stats()
    ttfts: list[float] = []
    itls: list[float] = []
    e2e: list[float] = []
    for batch in iterations:
        t0 = time.perf_counter()
        outputs = target.generate(Workload(batch, [output_len] * len(batch), "random"))
        e2e.append(time.perf_counter() - t0)
        for out in outputs:
            m = out.metrics
            if m is None or m.first_token_time is None:
                raise RuntimeError("the engine returned no RequestMetrics; cannot measure token latency")
            ttfts.append(m.first_token_time - m.arrival_time)
            itls += gaps(m.token_times)
    res = latency_result(ttfts, itls, e2e, len(iterations[0]), len(iterations[0][0]), output_len)
    res["kv"] = kv_delta(before, target.kv_stats())
    # Raw times for --plot; popped before the JSON is written (thousands of numbers per run).
    res["_samples"] = {"ttft_ms": [1e3 * t for t in ttfts], "itl_ms": [1e3 * t for t in itls]}
    return res


def run_latency_cli(args: argparse.Namespace) -> int:
    """Entry point of `pagedllm bench latency`; returns the exit status."""
    load_before = load_average()
    target = BenchTarget.from_args(args)
    threads = thread_count()
    seed = args.seed if args.seed is not None else 0
    token_ids = allowed_token_ids(int(target.hf_config.vocab_size), target.tokenizer)
    iterations = make_iterations(args.num_iters, args.batch_size, args.input_len, token_ids, seed)
    warm = make_iterations(1, args.batch_size, args.input_len, token_ids, seed + 1_000_003)[0]
    check_fits(Workload(iterations[0], [args.output_len] * args.batch_size, "random"), target.max_model_len)

    print(f"pagedllm: {args.num_iters} x batch {args.batch_size} ({args.input_len} in, {args.output_len} out), "
          f"{threads} threads ...", flush=True)
    results: dict[str, Result] = {
        OURS: run_ours(target, iterations, args.output_len, warm if args.warmup else None)
    }
    if args.compare_hf:
        results["transformers"] = _run_hf(args, target, iterations)
    if args.compare_llamacpp:
        results["llama.cpp"] = _run_llamacpp(args, target, iterations, threads)

    out: dict[str, Any] = report.header("latency", target.engine_summary(), threads, load_before)
    out["workload"] = {"input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
                       "num_iters": args.num_iters, "seed": seed, "warmup": args.warmup}
    samples = {name: r.pop("_samples") for name, r in results.items() if "_samples" in r}
    out["results"] = results
    out["ratios"] = report.ratios(results, ["decode_tok_per_s", "output_tok_per_s"],
                                  lower_better=["ttft_ms_p50", "tpot_ms_p50"])
    out["load_average_after"] = load_average()
    target.shutdown()

    report.print_table(f"latency, batch {args.batch_size} ({threads} threads, {report.cpu_model()})",
                       results, _COLUMNS)
    report.print_ratios(out["ratios"])
    kv = results[OURS].get("kv", {})
    if "spec_acceptance_rate" in kv:
        print(f"speculative decoding: {kv['spec_acceptance_rate']:.1%} of drafts accepted, "
              f"{kv['spec_mean_accepted_length']:.2f} accepted per verification")
    print(f"load average before {load_before}, after {out['load_average_after']}")
    if args.json_out:
        report.write_json(args.json_out, out)
    if args.plot:
        report.plot_latency(args.plot, samples)
    return 0


def _run_hf(args: argparse.Namespace, target: BenchTarget, iterations: list[list[list[int]]]) -> Result:
    from pagedllm.bench.hf_baseline import hf_latency, load_hf_model

    model = load_hf_model(target, args.hf_dtype)
    print("transformers: timing ...", flush=True)
    res = hf_latency(model, iterations, args.output_len, warmup=args.warmup)
    res["dtype"] = args.hf_dtype
    res["weights"] = "random (from_config)" if target.loader == "dummy" else "same as pagedllm"
    return res


def _run_llamacpp(
    args: argparse.Namespace, target: BenchTarget, iterations: list[list[list[int]]], threads: int
) -> Result:
    from pagedllm.bench.llamacpp_baseline import latency_job, run_isolated, unavailable_reason

    reason = unavailable_reason(target)
    if reason is None and args.batch_size != 1:
        reason = "llama-cpp-python's Llama decodes one sequence; its latency is measured at --batch-size 1 only"
    if reason is not None:
        print(f"llama.cpp skipped: {reason}")
        return {"skipped": reason}
    assert target.gguf_path is not None
    print("llama.cpp: timing in a child process ...", flush=True)
    return run_isolated(latency_job, target.gguf_path, threads, iterations, args.output_len, args.warmup)
