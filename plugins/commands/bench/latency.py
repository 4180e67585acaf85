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
import statistics
import time
from typing import Any

import numpy as np

from pagedllm.plugins.commands.bench import plots, report
from pagedllm.plugins.commands.bench.report import OURS, Result, gaps, latency_result
from pagedllm.plugins.commands.bench.target import BenchTarget, kv_delta, load_average, thread_count
from pagedllm.plugins.commands.bench.workloads import Workload, WorkloadError, allowed_token_ids, check_fits

_COLUMNS = [
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p90", "TTFT p90 ms"),
    ("tpot_ms_p50", "TPOT p50 ms"),
    ("tpot_ms_p90", "TPOT p90 ms"),
    ("prefill_tok_per_s", "prefill tok/s"),
    ("decode_tok_per_s", "decode tok/s"),
    ("output_tok_per_s", "out tok/s"),
    ("rss_mb", "RSS MB"),
    ("startup_s", "start-up s"),
]
LLAMACPP = "llama.cpp"


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
    return res


def run_latency_cli(args: argparse.Namespace) -> int:
    """Entry point of `pagedllm bench latency`; returns the exit status."""
    if args.plot:
        plots.require_matplotlib(args.plot)  # before the engine loads: a missing matplotlib costs no run
    load_before = load_average()
    target = BenchTarget.from_args(args)
    threads = thread_count()
    seed = args.seed if args.seed is not None else 0
    token_ids = allowed_token_ids(int(target.hf_config.vocab_size), target.tokenizer)
    iterations = make_iterations(args.num_iters, args.batch_size, args.input_len, token_ids, seed)
    warm = make_iterations(1, args.batch_size, args.input_len, token_ids, seed + 1_000_003)[0]
    check_fits(Workload(iterations[0], [args.output_len] * args.batch_size, "random"), target.max_model_len)

    rounds = max(1, getattr(args, "rounds", 1))
    variants = list(getattr(args, "compare_quantization", None) or [])
    print(f"pagedllm: {args.num_iters} x batch {args.batch_size} ({args.input_len} in, {args.output_len} out), "
          f"{threads} threads, {rounds} round(s) ...", flush=True)
    results = _run_rounds(args, target, iterations, warm, threads, rounds, variants)
    results[OURS]["startup_s"] = target.build_seconds
    results[OURS]["weights"] = target.weights()
    out: dict[str, Any] = report.header("latency", target.engine_summary(), threads, load_before)
    out["workload"] = {"input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
                       "num_iters": args.num_iters, "seed": seed, "warmup": args.warmup}
    samples = {name: r.pop("_samples") for name, r in results.items() if "_samples" in r}
    out["results"] = results
    out["ratios"] = report.ratios(results, ["decode_tok_per_s", "output_tok_per_s"],
                                  lower_better=["ttft_ms_p50", "tpot_ms_p50"])
    out["ratios"].update(_variants_vs_llamacpp(results))
    out["load_average_after"] = load_average()
    target.shutdown()

    report.print_table(f"latency, batch {args.batch_size} ({threads} threads, {report.cpu_model()})",
                       results, _COLUMNS)
    report.print_weights(results)
    report.print_ratios(out["ratios"])
    kv = results[OURS].get("kv", {})
    if "spec_acceptance_rate" in kv:
        print(f"speculative decoding: {kv['spec_acceptance_rate']:.1%} of drafts accepted, "
              f"{kv['spec_mean_accepted_length']:.2f} accepted per verification")
    print(f"load average before {load_before}, after {out['load_average_after']}")
    if args.json_out:
        report.write_json(args.json_out, out)
    if args.plot:
        plots.plot_latency(args.plot, samples, out)
    return 0


def _run_rounds(
    args: argparse.Namespace,
    target: BenchTarget,
    iterations: list[list[list[int]]],
    warm: list[list[int]],
    threads: int,
    rounds: int,
    variants: list[str],
) -> dict[str, Result]:
    """Every engine once per round, in the same order each round; a row is the median over rounds.

    NOTE(2): rounds alternate the engines so that a change of load on a shared machine falls on all of them
    alike; `rounds_decode_tok_per_s` keeps each round's figure to show the spread.
    """
    from pagedllm.plugins.commands.bench.engine_worker import (
        EngineWorker,
        llamacpp_latency_job,
        ours_latency_job,
        rss_fields,
        variant_args,
    )

    per_round: dict[str, list[Result]] = {}
    workers: dict[str, EngineWorker] = {}
    llamacpp_reason = _llamacpp_reason(args, target) if args.compare_llamacpp else None
    try:
        for name in [f"{OURS} (quantization {v})" for v in variants]:
            workers[name] = EngineWorker()
        if args.compare_llamacpp and llamacpp_reason is None:
            workers[LLAMACPP] = EngineWorker()
        for r in range(rounds):
            first = r == 0
            res = run_ours(target, iterations, args.output_len, warm if args.warmup and first else None)
            res["quantization"] = args.quantization or "auto"
            res.update(rss_fields())
            per_round.setdefault(OURS, []).append(res)
            for v in variants:
                name = f"{OURS} (quantization {v})"
                print(f"{name}: round {r + 1} in a child process ...", flush=True)
                job_warm = warm if args.warmup and first else None
                per_round.setdefault(name, []).append(
                    workers[name].call(ours_latency_job, variant_args(args, v), iterations, args.output_len, job_warm)
                )
            if LLAMACPP in workers:
                assert target.gguf_path is not None
                print(f"llama.cpp: round {r + 1} in a child process ...", flush=True)
                per_round.setdefault(LLAMACPP, []).append(workers[LLAMACPP].call(
                    llamacpp_latency_job, target.gguf_path, threads, iterations, args.output_len,
                    args.warmup and first,
                ))
    finally:
        for w in workers.values():
            w.close()
    results = {name: median_result(rows) for name, rows in per_round.items()}
    if args.compare_hf:
        results["transformers"] = _run_hf(args, target, iterations)
    if llamacpp_reason is not None:
        print(f"llama.cpp skipped: {llamacpp_reason}")
        results[LLAMACPP] = {"skipped": llamacpp_reason}
    if args.compare_vllm:
        # Once, after every round: vLLM's start-up (a model compile) is minutes, too long to repeat per round.
        from pagedllm.plugins.commands.bench.vllm_baseline import NAME, vllm_latency

        results[NAME] = vllm_latency(target, iterations, args.output_len, warm if args.warmup else None, threads,
                                     python=args.vllm_python, dtype=args.vllm_dtype, timeout_s=args.vllm_timeout)
    return results


def median_result(rows: list[Result]) -> Result:
    """One row from several rounds: the median of every number; samples pooled; the per-round decode tok/s."""
    out: Result = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            out[key] = statistics.median(values)
    if "_samples" in out:
        out["_samples"] = {k: [x for r in rows for x in r["_samples"][k]] for k in rows[0]["_samples"]}
    out["rounds_decode_tok_per_s"] = [round(r["decode_tok_per_s"], 2) for r in rows if r.get("decode_tok_per_s")]
    return out


def _variants_vs_llamacpp(results: dict[str, Result]) -> dict[str, dict[str, float]]:
    """decode tok/s of every other pagedllm row over llama.cpp's (the main row's is in report.ratios)."""
    base = results.get(LLAMACPP, {}).get("decode_tok_per_s")
    out: dict[str, dict[str, float]] = {}
    for name, res in results.items():
        if name.startswith(f"{OURS} (") and base and res.get("decode_tok_per_s"):
            out[f"{name}/{LLAMACPP}"] = {"decode_tok_per_s": round(res["decode_tok_per_s"] / base, 3)}
    return out


def _llamacpp_reason(args: argparse.Namespace, target: BenchTarget) -> str | None:
    from pagedllm.plugins.commands.bench.llamacpp_baseline import unavailable_reason

    reason = unavailable_reason(target)
    if reason is None and args.batch_size != 1:
        reason = "llama-cpp-python's Llama decodes one sequence; its latency is measured at --batch-size 1 only"
    return reason


def _run_hf(args: argparse.Namespace, target: BenchTarget, iterations: list[list[list[int]]]) -> Result:
    from pagedllm.plugins.commands.bench.hf_baseline import hf_latency, load_hf_model

    model = load_hf_model(target, args.hf_dtype)
    print("transformers: timing ...", flush=True)
    res = hf_latency(model, iterations, args.output_len, warmup=args.warmup)
    res["dtype"] = args.hf_dtype
    res["weights"] = "random (from_config)" if target.loader == "dummy" else "same as pagedllm"
    return res
