"""`pagedllm bench throughput`: many requests at once; requests/s and tok/s, ours beside the baselines.

Our engine gets every request up front (offline, like vLLM's benchmark_throughput) and schedules them
with continuous batching; transformers gets static batches; llama.cpp one request at a time; vLLM, in its
own interpreter, every request up front too. All of them decode the same token ids greedily to exactly the
same output lengths.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from pagedllm.plugins.commands.bench import plots, report
from pagedllm.plugins.commands.bench.report import OURS, Result
from pagedllm.plugins.commands.bench.target import BenchTarget, kv_delta, load_average, thread_count
from pagedllm.plugins.commands.bench.workloads import (
    Workload,
    allowed_token_ids,
    check_fits,
    file_workload,
    parse_range,
    random_workload,
)

_COLUMNS = [
    ("num_requests", "requests"),
    ("elapsed_s", "elapsed s"),
    ("requests_per_s", "req/s"),
    ("output_tok_per_s", "out tok/s"),
    ("total_tok_per_s", "total tok/s"),
    ("startup_s", "start-up s"),
]
_RATIO_KEYS = ["requests_per_s", "output_tok_per_s", "total_tok_per_s"]


def build_workload(args: argparse.Namespace, target: BenchTarget, token_ids: np.ndarray) -> Workload:
    """Random ids (the default) or the prompts file, with output lengths from --output-len[-range]."""
    seed = args.seed if args.seed is not None else 0
    out_range = parse_range(args.output_len_range, args.output_len)
    if args.prompts_file:
        return file_workload(args.prompts_file, target.tokenizer, out_range, seed, args.num_prompts)
    in_range = parse_range(args.input_len_range, args.input_len)
    return random_workload(args.num_prompts, in_range, out_range, token_ids, seed)


def warmup_workload(workload: Workload, token_ids: np.ndarray, seed: int) -> Workload:
    """A few requests shaped like the first ones but with fresh ids.

    NOTE(1): fresh ids, so the warm-up leaves nothing in the prefix cache that the timed run could hit.
    """
    rng = np.random.default_rng(seed + 1_000_003)
    n = min(4, len(workload))
    prompts = [rng.choice(token_ids, size=len(p)).tolist() for p in workload.prompts[:n]]
    return Workload(prompts, [min(8, o) for o in workload.output_lens[:n]], "warmup")


def run_ours(target: BenchTarget, workload: Workload, warmup: Workload | None) -> Result:
    """Time one `LLM.generate` over the whole workload, after an optional warm-up call."""
    if warmup is not None:
        target.generate(warmup)
    before = target.kv_stats()
    t0 = time.perf_counter()
    target.generate(workload)
    elapsed = time.perf_counter() - t0
    kv = kv_delta(before, target.kv_stats())
    return {
        "num_requests": len(workload),
        "elapsed_s": elapsed,
        "requests_per_s": len(workload) / elapsed,
        "output_tok_per_s": workload.output_tokens / elapsed,
        "total_tok_per_s": (workload.prompt_tokens + workload.output_tokens) / elapsed,
        "kv": kv,
    }


def run_hf(args: argparse.Namespace, target: BenchTarget, workload: Workload) -> Result:
    from pagedllm.plugins.commands.bench.hf_baseline import hf_throughput, load_hf_model

    t0 = time.perf_counter()
    model = load_hf_model(target, args.hf_dtype)
    load_s = time.perf_counter() - t0
    subset = workload.head(args.hf_max_prompts) if args.hf_max_prompts else workload
    print(f"transformers: {len(subset)} requests in static batches of {args.hf_batch_size} ...", flush=True)
    res = hf_throughput(model, subset, args.hf_batch_size, warmup=args.warmup)
    res["load_s"] = load_s
    res["dtype"] = args.hf_dtype
    res["weights"] = "random (from_config)" if target.loader == "dummy" else "same as pagedllm"
    return res


def run_llamacpp(args: argparse.Namespace, target: BenchTarget, workload: Workload, threads: int) -> Result:
    from pagedllm.plugins.commands.bench.llamacpp_baseline import (
        run_isolated,
        throughput_job,
        unavailable_reason,
    )

    reason = unavailable_reason(target)
    if reason is not None:
        print(f"llama.cpp skipped: {reason}")
        return {"skipped": reason}
    assert target.gguf_path is not None
    print(f"llama.cpp: {len(workload)} requests, one at a time, in a child process ...", flush=True)
    return run_isolated(throughput_job, target.gguf_path, threads, workload, args.warmup)


def run_throughput_cli(args: argparse.Namespace) -> int:
    """Entry point of `pagedllm bench throughput`; returns the exit status."""
    if args.plot:
        plots.require_matplotlib(args.plot)  # before the engine loads: a missing matplotlib costs no run
    load_before = load_average()
    target = BenchTarget.from_args(args)
    threads = thread_count()
    vocab = int(target.hf_config.vocab_size)
    token_ids = allowed_token_ids(vocab, target.tokenizer)
    workload = build_workload(args, target, token_ids)
    check_fits(workload, target.max_model_len)
    seed = args.seed if args.seed is not None else 0
    warm = warmup_workload(workload, token_ids, seed) if args.warmup else None

    print(f"pagedllm: {len(workload)} requests, {workload.prompt_tokens} prompt + "
          f"{workload.output_tokens} output tokens, {threads} threads ...", flush=True)
    results: dict[str, Result] = {OURS: run_ours(target, workload, warm)}
    results[OURS]["startup_s"] = target.build_seconds
    results[OURS]["weights"] = target.weights()
    if args.compare_hf:
        results["transformers"] = run_hf(args, target, workload)
    if args.compare_llamacpp:
        results["llama.cpp"] = run_llamacpp(args, target, workload, threads)
    if args.compare_vllm:
        from pagedllm.plugins.commands.bench.vllm_baseline import NAME, vllm_throughput

        results[NAME] = vllm_throughput(target, workload, warm, threads, python=args.vllm_python,
                                        dtype=args.vllm_dtype, timeout_s=args.vllm_timeout)

    out: dict[str, Any] = report.header("throughput", target.engine_summary(), threads, load_before)
    out["workload"] = {**workload.describe(), "seed": seed, "warmup": args.warmup}
    out["results"] = results
    out["ratios"] = report.ratios(results, _RATIO_KEYS)
    out["load_average_after"] = load_average()
    target.shutdown()

    report.print_table(f"throughput ({threads} threads, {report.cpu_model()})", results, _COLUMNS)
    kv = results[OURS]["kv"]
    print(f"pagedllm KV: {kv['num_preemptions']} preemptions, prefix-cache hit rate "
          f"{kv['prefix_cache_hit_rate']:.1%}, {kv['num_steps']} steps")
    report.print_weights(results)
    report.print_ratios(out["ratios"])
    print(f"load average before {load_before}, after {out['load_average_after']}")
    if args.json_out:
        report.write_json(args.json_out, out)
    if args.plot:
        plots.plot_throughput(args.plot, out)
    return 0
