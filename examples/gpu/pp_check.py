"""Pipeline parallelism on a multi-GPU host (NCCL): pp=2 (and tp=2 x pp=2 on 4 GPUs) tokens against pp=1.

    python examples/gpu/pp_check.py --out $OUT/pp_check.json [--requests 256]

A ~150M random Llama (8 layers, 8 q heads, 2 KV heads), float32 then bf16: greedy tokens of each layout
against pp=1 for 4 prompts x 32 tokens, then the wall time of `--requests` requests (128 in, 128 out) per
layout, the figure the micro-batches in flight (engine/batch_queue.py) should move. Not yet run on GPUs
(CPU/gloo only in CI: tests/test_pipeline_parallel.py); the JSON is rewritten after each layout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from typing import Any

import torch


def save_model() -> str:
    import transformers

    folder = tempfile.mkdtemp(prefix="pp-small-")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.05, tie_word_embeddings=False,
    )
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def run_layout(model: str, dtype: str, tp: int, pp: int, requests: int) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [1 + (i * 37 + j * 11) % 31000 for j in range(8 + 5 * i)]} for i in range(4)]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    load = [{"prompt_token_ids": [1 + (i * 13 + j) % 31000 for j in range(128)]} for i in range(requests)]
    with LLM(model, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             gpu_memory_utilization=0.5) as llm:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        t0 = time.perf_counter()
        llm.generate(load, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=128), use_tqdm=False)
        seconds = time.perf_counter() - t0
    return {"tokens": tokens, "load_seconds": seconds, "load_tok_s": requests * 256 / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    layouts = [(1, 1), (1, 2)] + ([(2, 2)] if gpus >= 4 else [])
    model = save_model()
    results: dict[str, Any] = {"gpus": gpus, "requests": args.requests}
    for dtype in ("float32", "bfloat16"):
        for tp, pp in layouts:
            key = f"{dtype} tp{tp} pp{pp}"
            try:
                results[key] = run_layout(model, dtype, tp, pp, args.requests)
                base = results.get(f"{dtype} tp1 pp1")
                if base and "tokens" in base:
                    results[key]["tokens_equal_pp1"] = results[key]["tokens"] == base["tokens"]
            except Exception:
                results[key] = {"error": traceback.format_exc()}
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
