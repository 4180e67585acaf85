"""Where a decode step's time goes on the GPU: host phases timed by hand, device kernels by torch.profiler.

Run on the GPU machine: `python examples/gpu/profile_decode.py --batch 1` (Llama-8B shape, dummy weights,
triton backend, CUDA graphs as configured; `--quantization gptq` etc. as bench_suite.py's). Prints the host-side split of one step (schedule, runner, sampler,
update) and the top device kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from h200_check import LLAMA_8B_CONFIG, make_model_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=128, help="context of each decoding request (W2/W5: ~600)")
    ap.add_argument("--wave", type=int, default=0,
                    help="then profile one prompt wave: this many fresh prompts beside the decoding batch (W1: 16)")
    ap.add_argument("--wave-len", type=int, default=1024)
    ap.add_argument("--shape", default=None,
                    help="a model shape of examples/gpu/model_shapes.py (default: the Llama-3.1-8B shape)")
    ap.add_argument("--quantization", default=None,
                    help="dummy packed weights of a checkpoint format, as bench_suite.py's (gptq | awq | gguf-<type>)")
    args = ap.parse_args()

    from bench_suite import checkpoint_quantization
    from model_shapes import id_high, shape_config

    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineConfig

    qc = checkpoint_quantization(args.quantization)
    base = shape_config(args.shape) if args.shape else LLAMA_8B_CONFIG
    model_config = {**base, "quantization_config": qc} if qc else base
    path = make_model_dir(model_config, tempfile.mkdtemp(), args.shape or "llama8b")
    high = id_high(args.shape) if args.shape else 128000
    cfg = EngineConfig.from_dict({
        "model": path, "dtype": "bfloat16", "device": "cuda", "attention": {"backend": "triton"},
        "loader": {"name": "dummy"}, "enforce_eager": args.eager,
        "quantization": {"method": None if qc else args.quantization},
        "scheduler": {"max_num_seqs": max(256, args.batch + args.wave), "max_num_batched_tokens": 16384},
    })
    llm = LLM(config=cfg)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    prefill_steps = -(-args.batch * args.prompt_len // 16384)
    params = SamplingParams(max_tokens=args.steps + 8 + prefill_steps, temperature=0.0, ignore_eos=True,
                            detokenize=False)

    def add(tag: str) -> None:
        for i in range(args.batch):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": torch.randint(100, high, (args.prompt_len,), generator=g).tolist()}, params)

    llm.generate([{"prompt_token_ids": [5] * 64}] * 4, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    add("w")
    while engine.has_unfinished_requests():
        engine.step()

    sched = engine.core.scheduler
    timings: dict[str, float] = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "frontend": 0.0}
    core = engine.core
    exec_name = "_execute_pipelined" if core.async_scheduling else "_execute"  # the bound method the core calls
    orig_schedule, orig_execute, orig_update = sched.schedule, getattr(core, exec_name), sched.update_from_output

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            timings[name] += time.perf_counter() - t
            return out
        return wrapper

    add("p")
    for _ in range(prefill_steps + 4):  # the prefill chunks, then a few decodes
        engine.step()
    sched.schedule = timed("schedule", orig_schedule)
    setattr(core, exec_name, timed("execute", orig_execute))
    sched.update_from_output = timed("update", orig_update)
    t0 = time.perf_counter()
    n = args.steps // 2
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    timings["frontend"] = wall - timings["schedule"] - timings["execute"] - timings["update"]
    sched.schedule, sched.update_from_output = orig_schedule, orig_update
    setattr(core, exec_name, orig_execute)
    report = {"batch": args.batch, "eager": args.eager, "ms_per_step": round(1e3 * wall / n, 3),
              **{f"{k}_ms": round(1e3 * v / n, 3) for k, v in timings.items()}}

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    if args.wave:  # W1 / W5's prompt waves: fresh prompts beside the decoding batch, one step (eager: no graph)
        for i in range(args.wave):
            engine.add_request(f"wave{i}", {"prompt_token_ids": torch.randint(
                100, high, (args.wave_len,), generator=g).tolist()}, params)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as wave_prof:
            t = time.perf_counter()
            for _ in range(2):  # with async scheduling the wave may run in the second call
                engine.step()
            torch.cuda.synchronize()
            report["wave_2steps_ms"] = round(1e3 * (time.perf_counter() - t), 3)
        print(f"two steps, one of them the wave: {args.wave} x {args.wave_len} fresh tokens beside {args.batch} decodes")
        print(wave_prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=70))
    print("PROFILE_JSON=" + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
