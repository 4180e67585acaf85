"""Where a speculative verification step's time goes (host phases by hand, kernels by torch.profiler).

    python examples/gpu/profile_spec.py [--tiny --device cpu]

Llama-8B shape, dummy weights, batch 1, drafts replayed from the plain run's output (bench_spec.py's
ReplayProposer) with keep 1.0 and 0.6; prints ms per step split into schedule / forward / verify / propose /
update and the top kernels and host ops of a few verification steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_spec import LLAMA_8B_CONFIG, TINY_CONFIG, ReplayProposer, single_stream  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--eager-verify", action="store_true", help="no CUDA graphs for verification steps")
    args = ap.parse_args()
    from pagedllm import LLM
    from pagedllm.config import EngineConfig
    from pagedllm.spec_decode.speculator import Speculator

    on_gpu = args.device == "cuda"
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY_CONFIG if args.tiny else LLAMA_8B_CONFIG, f)
    cfg = EngineConfig.from_dict({
        "model": model_dir, "dtype": "bfloat16" if on_gpu else "float32", "device": args.device, "seed": 0,
        "attention": {"backend": "triton" if on_gpu else "torch"}, "loader": {"name": "dummy"},
        "kv_cache": {"gpu_memory_utilization": 0.85} if on_gpu else {"memory_gb": 0.5},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 2048}, "max_model_len": 4096,
    })
    llm = LLM(config=cfg)
    engine, parts = llm.engine, llm.engine.parts
    runner, sched = parts.runner, engine.core.scheduler
    if on_gpu and "--eager-verify" not in sys.argv:
        runner.capture_cuda_graphs(query_lens=(5,))
    vocab = int(parts.info.hf_config.vocab_size)
    prompt = [1000 + (i * 7919) % (vocab - 2000) for i in range(600)]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    runner.speculator = None
    single_stream(llm, prompt[:100], 8, "warm")
    reference = single_stream(llm, prompt, args.out_len, "ref")["tokens"]
    timings: dict[str, float] = {}

    def timed(obj: Any, name: str, key: str) -> Any:
        fn = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
            return out

        setattr(obj, name, wrapper)
        return fn

    for keep in (1.0, 0.6):
        spec = Speculator(ReplayProposer(reference, len(prompt), keep, vocab), 4, parts.max_model_len, vocab)
        runner.speculator = spec
        single_stream(llm, prompt[:100], 16, f"w{keep}")
        plain = single_stream(llm, prompt, args.out_len, f"p{keep}")
        timings.clear()
        saved = [
            (sched, "schedule", timed(sched, "schedule", "schedule")),
            (runner, "execute", timed(runner, "execute", "execute")),
            (sched, "update_from_output", timed(sched, "update_from_output", "update")),
            (runner, "_forward", timed(runner, "_forward", "  forward")),
            (spec, "verify", timed(spec, "verify", "  verify")),
            (spec, "propose", timed(spec, "propose", "  propose")),
        ]
        steps = 0
        from pagedllm import SamplingParams

        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.out_len, detokenize=False)
        engine.add_request(f"t{keep}", {"prompt_token_ids": prompt}, params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        sync()
        wall = time.perf_counter() - t0
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        print(f"keep={keep}: untimed {plain['tok_per_s']:.1f} tok/s, acceptance {plain['acceptance_rate']}; "
              f"timed {steps} steps, {1e3 * wall / steps:.2f} ms/step: "
              + ", ".join(f"{k.strip()} {1e3 * v / steps:.2f}" for k, v in timings.items()), flush=True)

        from torch.profiler import ProfilerActivity, profile

        engine.add_request(f"q{keep}", {"prompt_token_ids": prompt}, params)
        for _ in range(4):
            engine.step()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=acts) as prof:
            for _ in range(6):
                engine.step()
            sync()
        while engine.has_unfinished_requests():
            engine.step()
        if on_gpu:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=55))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=55))
    runner.speculator = None
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
