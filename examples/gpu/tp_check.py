"""Tensor parallelism on a multi-GPU host (NCCL): tp=2 vs tp=1 tokens, then Llama-8B-shape throughput/latency.

    python examples/gpu/tp_check.py --out $OUT/tp_check.json [--tp 2] [--scale 0.2]

Stages (the JSON is rewritten after each, so a crash keeps the earlier ones):
  a  a ~150M random Llama (8 q heads, 2 KV heads, vocab 32001 so the vocabulary is padded), float32 and bf16:
     greedy tokens of tp=N against tp=1, 4 prompts x 32 tokens
  b  Llama-3.1-8B shape, bf16, dummy weights (the same weights at any tp), CUDA graphs: W1 (1024 in, 128 out)
     and W2 (128 in, 1024 out) throughput at `scale` of issue 5's request counts, W3 (1 x 128 in, 256 out)
     ms per token, at tp=1 and tp=N; `--async-scheduling off` runs tp=N with synchronous steps (the default,
     `auto`, pipelines them on CUDA at any tp), `both` runs tp=N both ways
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any

import numpy as np
import torch

if os.environ.get("TP_HANG_DUMP_S"):  # module level: spawned tensor-parallel workers run this too
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["TP_HANG_DUMP_S"]), exit=True)

# The issue-5 suite's shape (examples/gpu/bench_suite.py).
LLAMA_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
}


def single_stream(engine: Any, ids: list[int], out_len: int, rid: str) -> float:
    """ms per output token of one request alone: (last token's time - first's) / (n - 1)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len, detokenize=False)
    stamps: list[float] = []
    seen = 0
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)  # cumulative: stamp only the new ones
            stamps.extend([t] * (n - seen))
            seen = n
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def write(path: str, results: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def tokens_of(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def stage_a(tp: int, results: dict[str, Any], dtypes: list[str], eager: bool) -> None:
    import transformers

    from pagedllm import LLM, SamplingParams

    folder = tempfile.mkdtemp(prefix="tp-small-")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32001, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.05, tie_word_embeddings=False,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1, 32000, n).tolist()} for n in (7, 33, 100, 260)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for dtype in dtypes:
        got = {}
        for size in (1, tp):
            t0 = time.perf_counter()
            llm = LLM(folder, dtype=dtype, tensor_parallel_size=size, gpu_memory_utilization=0.3,
                      enforce_eager=eager)
            build = time.perf_counter() - t0
            got[size] = tokens_of(llm.generate(prompts, params, use_tqdm=False))
            results["a"][f"{dtype}_tp{size}_build_s"] = round(build, 1)
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
        same = sum(a == b for x, y in zip(got[1], got[tp]) for a, b in zip(x, y))
        results["a"][f"{dtype}_tokens_equal"] = f"{same}/{sum(len(x) for x in got[1])}"
        print(f"a {dtype}: tp={tp} tokens equal to tp=1: {same}/{sum(len(x) for x in got[1])}", flush=True)


def stage_b(tp: int, scale: float, results: dict[str, Any], async_mode: str = "auto") -> None:
    from pagedllm import LLM, SamplingParams

    folder = tempfile.mkdtemp(prefix="llama8b-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(LLAMA_8B_CONFIG, f)
    rng = np.random.default_rng(0)
    n1, n2 = max(1, int(1000 * scale)), max(1, int(500 * scale))
    w1 = [{"prompt_token_ids": rng.integers(1000, 120000, 1024).tolist()} for _ in range(n1)]
    w2 = [{"prompt_token_ids": rng.integers(1000, 120000, 128).tolist()} for _ in range(n2)]
    w3 = {"prompt_token_ids": rng.integers(1000, 120000, 128).tolist()}
    modes = {"auto": [None], "off": [False], "both": [True, False]}[async_mode]
    for size, async_scheduling in [(1, None)] + [(tp, a) for a in modes]:
        key = f"tp{size}" + ("" if async_scheduling is None else "_async" if async_scheduling else "_sync")
        t0 = time.perf_counter()
        llm = LLM(folder, load_format="dummy", dtype="bfloat16", tensor_parallel_size=size,
                  max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
                  **({} if async_scheduling is None else {"async_scheduling": async_scheduling}))
        res: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1)}
        llm.generate(w2[:8], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
        for name, prompts, out_len in (("W1", w1, 128), ("W2", w2, 1024)):
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
            wall = time.perf_counter() - t0
            total = sum(len(p["prompt_token_ids"]) + out_len for p in prompts)
            res[f"{name}_tok_s"] = round(total / wall)
        engine = llm.engine
        per_token = [single_stream(engine, w3["prompt_token_ids"], 256, f"w3-{run}") for run in range(3)]
        res["W3_ms_per_token"] = round(statistics.median(per_token), 3)
        results["b"][key] = res
        print(f"b {key}: {res}", flush=True)
        llm.shutdown()
        del llm, engine
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tp_check.json"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.2)
    ap.add_argument("--stages", default="a,b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--async-scheduling", choices=["auto", "off", "both"], default="auto",
                    help="tp=N in stage b: engine default (pipelined on CUDA), synchronous, or both")
    args = ap.parse_args()
    results: dict[str, Any] = {"gpus": torch.cuda.device_count(), "tp": args.tp, "scale": args.scale,
                               "a": {}, "b": {}}
    status = 0
    for stage in args.stages.split(","):
        try:
            if stage == "a":
                stage_a(args.tp, results, args.dtypes.split(","), args.eager)
            else:
                stage_b(args.tp, args.scale, results, args.async_scheduling)
        except Exception:
            results[f"{stage}_error"] = traceback.format_exc()
            print(results[f"{stage}_error"], flush=True)
            status = 1
        write(args.out, results)
    print(json.dumps(results, indent=1))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
