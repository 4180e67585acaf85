"""Cascade attention on the GPU: the same greedy tokens with and without it (triton backend, CUDA graphs).

    python examples/gpu/cascade_check.py [--out $OUT/cascade.json]
    python examples/gpu/cascade_check.py --requests 300 --prefix-len 760    # DECODE_BIG's steps, ALIGN 128

A ~100M Llama with a wide random init (peaked logits, so greedy ids are not decided by rounding), float16.
48 requests: 40 share a 640-token system prefix (prefix caching hands them the same blocks), 8 do not, each
with its own 16-64-token suffix; 48 greedy tokens each. Run twice in one process -- cascade on (the default)
and off (CASCADE_MIN_TOKENS raised) -- and compare every token; also how many decode steps used it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from typing import Any

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cascade.json"))
    ap.add_argument("--requests", type=int, default=48, help="5 of every 6 share the prefix")
    ap.add_argument("--prefix-len", type=int, default=640)
    args = ap.parse_args()
    import transformers

    import pagedllm.worker.cuda_graphs as cuda_graphs
    from pagedllm import LLM, SamplingParams

    root = tempfile.mkdtemp(prefix="cascade-")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                                   num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                                   max_position_embeddings=4096, initializer_range=0.25, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(root)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(10, 31000, (args.prefix_len,), generator=g).tolist()
    prompts = []
    for i in range(args.requests):
        suffix = torch.randint(10, 31000, (16 + i % 49,), generator=g).tolist()
        head = prefix if i % 6 else torch.randint(10, 31000, (args.prefix_len,), generator=g).tolist()
        prompts.append({"prompt_token_ids": head + suffix})
    # top-2 logprobs: where on and off part, is the off run's top-two gap a near tie (rounding) or not (a bug)?
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=2)

    used = {"steps": 0, "cascade_steps": 0}
    orig = cuda_graphs.shared_prefix

    def counting(host: Any) -> Any:
        found = orig(host)
        used["steps"] += 1
        used["cascade_steps"] += int(found[0] > 0)
        return found

    cuda_graphs.shared_prefix = counting
    tokens: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list[Any]] = {}
    report: dict[str, Any] = {}
    for mode in ("on", "off"):
        cuda_graphs.CASCADE_MIN_TOKENS = 256 if mode == "on" else 1 << 30
        used.update(steps=0, cascade_steps=0)
        llm = LLM(root, device="cuda", dtype="float16", attention={"backend": "triton"},
                  max_num_seqs=max(64, args.requests),
                  max_num_batched_tokens=2048, seed=0)
        # the first request alone, so that the others find its prefix blocks cached
        llm.generate([prompts[1]], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
        logprobs[mode] = [o.outputs[0].logprobs for o in outs]
        report[f"{mode}_decode_steps_with_cascade"] = f"{used['cascade_steps']}/{used['steps']}"
        llm.shutdown()
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for x, y in zip(tokens["on"], tokens["off"]) for a, b in zip(x, y))
    report["tokens_equal"] = f"{same}/{sum(len(x) for x in tokens['on'])}"
    report["first_diff"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                            for x, y in zip(tokens["on"], tokens["off"])]
    # Before the first difference: the largest on-vs-off change of the chosen token's logprob (rounding size?);
    # at it: the off run's gap between its top two (a near tie lets rounding pick the other).
    drift, gaps = 0.0, []
    for r, first in enumerate(report["first_diff"]):
        on, off = logprobs["on"][r], logprobs["off"][r]
        upto = len(tokens["off"][r]) if first is None else first
        for j in range(upto):
            t = tokens["off"][r][j]
            drift = max(drift, abs(on[j][t].logprob - off[j][t].logprob))
        if first is not None:
            top = sorted((lp.logprob for lp in off[first].values()), reverse=True)
            gaps.append(round(top[0] - top[1], 4))
    report["max_logprob_drift_before_parting"] = round(drift, 4)
    report["off_top2_gap_where_parting"] = gaps
    print(json.dumps(report), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
