"""Greedy parity on real weights: the SmolLM2 GGUF (dequantized, bf16 and fp16) with the triton and torch
attention backends on the GPU. Usage: `python examples/gpu/real_parity.py MODEL.gguf [--tokens 64]`."""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from pagedllm import LLM, SamplingParams

    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain what a KV cache is in two sentences.", "List five prime numbers."]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    report: dict[str, object] = {}
    for dtype in ("bfloat16", "float16"):
        tokens = {}
        for backend in ("torch", "triton"):
            llm = LLM(args.model, dtype=dtype, device="cuda", attention_backend=backend, quantization="none",
                      max_num_batched_tokens=64, enforce_eager=backend == "torch")
            outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
            tokens[backend] = [o.outputs[0].token_ids for o in outs]
            if backend == "triton":
                report[f"{dtype}_text0"] = outs[0].outputs[0].text[:120]
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                      for x, y in zip(tokens["torch"], tokens["triton"])]
        report[dtype] = {"equal": tokens["torch"] == tokens["triton"], "first_divergence": first_diff,
                         "tokens": args.tokens}
    print("PARITY_JSON=" + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
