"""Where W1-W5 spend their time, step by step (H200): the bench_suite engine with every step traced.

    python examples/gpu/trace_steps.py [--shape llama-3.2-1b] [--workloads W1,W2,W3,W4,W5] [--scale 1.0]
                                       [--max-num-seqs 1024]

Per engine step it records the host clock at the step's start, the step's shape (tokens, requests, decodes),
whether the forward replayed a CUDA graph, and two CUDA events around the runner's work (forward + sampler)
that are read only at the end (no extra syncs). Steps are grouped by kind -- decode replayed, decode eager,
mixed <= 512 tokens, mixed > 512 tokens -- and each group prints: steps, tokens, host wall time (start to
next start), GPU span (start event to end event: device busy or waiting for launches) and the device idle
time before the step (previous end event to this start event: the host was late).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_suite import make_prompts, w4_prompts, w5_prompts  # noqa: E402
from model_shapes import DEFAULT_SHAPE, SHAPES, default_model_dir, id_high, write_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=DEFAULT_SHAPE, choices=list(SHAPES))
    ap.add_argument("--workloads", default="W4,W5")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--model-dir", default=None, help="default: model_shapes.default_model_dir(shape)")
    ap.add_argument("--no-cascade", action="store_true", help="report no shared prefix (cuda_graphs NOTE 4)")
    args = ap.parse_args()
    if args.no_cascade:
        import pagedllm.worker.cuda_graphs as cuda_graphs

        cuda_graphs.CASCADE_MIN_TOKENS = 1 << 30
    model_dir = write_config(args.model_dir or default_model_dir(args.shape, "_pagedllm"), args.shape)
    high = id_high(args.shape)

    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineConfig

    cfg = EngineConfig.from_dict({
        "model": model_dir, "dtype": "bfloat16", "device": "cuda", "seed": 0,
        "attention": {"backend": "triton"}, "loader": {"name": "dummy"},
        "kv_cache": {"gpu_memory_utilization": 0.9},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
    })
    llm = LLM(config=cfg)
    core = llm.engine.core
    runner = core.runner if hasattr(core, "runner") else core.executor.runner
    records: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    sched = core.scheduler
    orig_schedule = sched.schedule

    def schedule() -> Any:
        so = orig_schedule()
        n = so.num_scheduled_tokens
        current.update(t=time.perf_counter(), tokens=so.total_num_scheduled_tokens, reqs=len(n),
                       decodes=sum(1 for v in n.values() if v == 1), graphed=False, prefix=0)
        return so

    sched.schedule = schedule
    import pagedllm.worker.cuda_graphs as cuda_graphs

    orig_prefix = cuda_graphs.shared_prefix

    def shared_prefix(host: Any) -> Any:
        found = orig_prefix(host)
        current["prefix"] = found[0]
        return found

    cuda_graphs.shared_prefix = shared_prefix
    graphs = runner._graphs
    if graphs is not None:
        orig_run = graphs.run

        def run(host: Any, fill: Any = None) -> Any:
            out = orig_run(host, fill)
            current["graphed"] = out is not None
            return out

        graphs.run = run
    # The engine core holds the bound method it calls (engine_core NOTE: no extra hop): wrap that one.
    name = "_execute_pipelined" if core.async_scheduling else "_execute"
    orig_exec = getattr(core, name)

    def execute(so: Any) -> Any:
        if so.total_num_scheduled_tokens == 0:
            return orig_exec(so)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = orig_exec(so)
        end.record()
        records.append(dict(current, start=start, end=end))
        return out

    setattr(core, name, execute)

    def summarize(label: str, recs: list[dict[str, Any]], wall: float) -> None:
        torch.cuda.synchronize()
        groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for i, r in enumerate(recs):
            if r["decodes"] == r["reqs"]:
                kind = "decode graphed" if r["graphed"] else "decode eager"
                kind += " cascade" if r["prefix"] else ""
            else:
                kind = "mixed <=512" if r["tokens"] <= 512 else ("mixed <=2048" if r["tokens"] <= 2048
                                                                else "mixed >2048")
            g = groups[kind]
            g["steps"] += 1
            g["tokens"] += r["tokens"]
            g["reqs"] += r["reqs"]
            if i + 1 < len(recs):
                g["host_ms"] += (recs[i + 1]["t"] - r["t"]) * 1e3
                g["gpu_ms"] += r["start"].elapsed_time(r["end"])
                g["idle_after_ms"] += r["end"].elapsed_time(recs[i + 1]["start"])
        # The decode tail: steps after the last one that carried a prompt chunk (nothing left to admit).
        last_mixed = max((i for i, r in enumerate(recs) if r["decodes"] != r["reqs"]), default=-1)
        tail = recs[last_mixed + 1:]
        tail_gpu = sum(r["start"].elapsed_time(r["end"]) for r in tail)
        tail_wall = (tail[-1]["t"] - tail[0]["t"]) * 1e3 if len(tail) > 1 else 0.0
        print(f"== {label}: {len(recs)} steps, wall {wall:.2f} s; decode tail after the last prompt chunk: "
              f"{len(tail)} steps, {sum(r['reqs'] for r in tail)} tokens, {tail_gpu:.0f} ms GPU, {tail_wall:.0f} ms host")
        print(f"{'kind':16s} {'steps':>6s} {'tok/step':>9s} {'req/step':>9s} {'host ms':>9s} {'gpu span':>9s} "
              f"{'idle after':>10s} {'host/step':>9s} {'gpu/step':>9s}")
        for kind, g in sorted(groups.items()):
            s = g["steps"]
            print(f"{kind:16s} {int(s):6d} {g['tokens'] / s:9.1f} {g['reqs'] / s:9.1f} {g['host_ms']:9.0f} "
                  f"{g['gpu_ms']:9.0f} {g['idle_after_ms']:10.0f} {g['host_ms'] / s:9.2f} {g['gpu_ms'] / s:9.2f}")

    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16, detokenize=False)
    llm.generate([{"prompt_token_ids": list(range(1000, 1256))}] * 4, warm, use_tqdm=False)
    for wl in args.workloads.split(","):
        if wl == "W4":
            prompts = w4_prompts(max(1, int(1000 * args.scale)), high)
            outs = [128] * len(prompts)
        elif wl == "W1":
            prompts = [[int(x) for x in r] for r in make_prompts(high)["W1"][: max(1, int(1000 * args.scale))]]
            outs = [128] * len(prompts)
        elif wl == "W2":
            prompts = [[int(x) for x in r] for r in make_prompts(high)["W2"][: max(1, int(500 * args.scale))]]
            outs = [1024] * len(prompts)
        elif wl == "W3":  # one stream, bench_suite's first W3 prompt and length
            prompts, outs = [[int(x) for x in make_prompts(high)["W3"][0]]], [512]
        else:
            prompts, outs = w5_prompts(max(1, int(1000 * args.scale)), high)
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in outs]
        records.clear()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        summarize(wl, list(records), wall)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
