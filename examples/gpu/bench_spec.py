"""Speculative decoding at batch 1 on one GPU: tok/s with and without it, and the acceptance behind each number.

    python examples/gpu/bench_spec.py --out $OUT/spec.json [--out-len 256] [--repeats 3] [--backend triton]
    python examples/gpu/bench_spec.py --tiny --device cpu      # a CPU dry run of the whole script (minutes)
    python examples/gpu/bench_spec.py --model SmolLM2.gguf --device cpu   # real weights: a real acceptance

With --model (real weights) the prompt is a chat asking the model to return a Python file with one small
edit, so the answer copies most of the prompt: the ngram rows then show the acceptance a real model gets.

Llama-3.1-8B shape, bf16, dummy weights, CUDA graphs for plain decode steps and for verification steps
(k + 1 tokens per request, graphs captured for k = 2 and 4), greedy, ignore_eos. One engine is
built once; each configuration swaps the runner's Speculator (what `speculative.method` would build):

  none          plain decoding (the baseline; decode steps replay CUDA graphs)
  ngram k=2/4   prompt lookup on a copy-heavy prompt ("edit this file": a 512-token random "file", then its
                first 64 tokens again). Dummy weights do not copy the file, so the acceptance here is whatever
                the random model's own repetition gives: report it next to the tok/s, it is the real number.
  replay k=4    drafts replayed from the plain run's own greedy output, each draft kept with probability r
                (1.0 and 0.6), else replaced by another id. Greedy verification makes the output identical
                either way, so this measures the speed speculation reaches at a known acceptance rate -- the
                part of the issue dummy weights cannot give through a real proposer.

Per configuration: tok/s = (n - 1) / (last token time - first token time), median of --repeats single-stream
runs (bench_suite.py's W3 method), the acceptance rate and drafts accepted per verification from the
scheduler's counters, and whether the tokens equal the plain run's (they must: greedy). The last lines
printed are a table; everything is also in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from h200_check import LLAMA_8B_CONFIG  # noqa: E402

TINY_CONFIG = {**LLAMA_8B_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
               "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """Length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
EDIT = "Rename the function merge_intervals to merge_ranges everywhere. Reply with the whole file only.\n\n"


class ReplayProposer:
    """Proposes the plain run's next tokens, each kept with probability `keep` (else another id)."""

    def __init__(self, reference: list[int], prompt_len: int, keep: float, vocab: int, seed: int = 0) -> None:
        self.reference, self.prompt_len, self.keep, self.vocab = reference, prompt_len, keep, vocab
        self.rng = random.Random(seed)

    def propose(self, requests: list[Any]) -> Any:
        from pagedllm.spec_decode.proposer import Proposals

        out = []
        for r in requests:
            done = len(r.token_ids) - self.prompt_len
            ids = self.reference[done : done + r.max_drafts]
            out.append([t if self.rng.random() < self.keep else (t + 1) % self.vocab for t in ids])
        return Proposals(out, [None] * len(out))

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        pass


def single_stream(llm: Any, ids: list[int], out_len: int, rid: str) -> dict[str, Any]:
    """One request alone, stepped by hand; every token stamped when its step returns."""
    from pagedllm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len, detokenize=False)
    before = engine.get_stats()
    drafts0, tokens0, accepted0 = before.spec_num_drafts, before.spec_num_draft_tokens, before.spec_num_accepted_tokens
    stamps: list[float] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            new = o.outputs[0].token_ids[len(tokens):]
            tokens.extend(new)
            stamps.extend([t] * len(new))
    s = engine.get_stats()
    drafts, draft_tokens = s.spec_num_drafts - drafts0, s.spec_num_draft_tokens - tokens0
    accepted = s.spec_num_accepted_tokens - accepted0
    return {
        "ttft_ms": (stamps[0] - t0) * 1e3,
        "tok_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "tokens": tokens,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "accepted_per_verification": accepted / drafts if drafts else None,
        "verifications": drafts,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "spec.json"))
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small random model (dry run of the script)")
    ap.add_argument("--model", help="real weights (folder or .gguf) instead of the dummy 8B")
    args = ap.parse_args()

    from pagedllm import LLM
    from pagedllm.config import EngineConfig
    from pagedllm.plugins.proposers.ngram.proposer import NgramProposer
    from pagedllm.spec_decode.proposer import ProposerContext
    from pagedllm.spec_decode.speculator import Speculator

    on_gpu = args.device == "cuda"
    if args.model:
        model_dir, loader = args.model, None
    else:
        model_dir, loader = tempfile.mkdtemp(prefix="spec_bench_"), "dummy"
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_CONFIG if args.tiny else LLAMA_8B_CONFIG, f)
    cfg = EngineConfig.from_dict({
        "model": model_dir, "dtype": "bfloat16" if on_gpu else "float32", "device": args.device, "seed": 0,
        "attention": {"backend": args.backend if on_gpu else "torch"}, "loader": {"name": loader},
        "kv_cache": {"gpu_memory_utilization": 0.85} if on_gpu else {"memory_gb": 0.5},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 2048},
        "max_model_len": 4096,
    })
    result: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "model": args.model or ("tiny" if args.tiny else "llama-8b dummy"),
        "out_len": args.out_len, "configs": {},
    }
    t0 = time.perf_counter()
    llm = LLM(config=cfg)
    result["startup_s"] = round(time.perf_counter() - t0, 2)
    parts = llm.engine.parts
    runner = parts.runner
    if on_gpu:  # the engine does this itself when `speculative` is configured; here k is swapped per row
        runner.capture_cuda_graphs(query_lens=(3, 5))
        result["graph_sizes_by_query_len"] = {str(q): v for q, v in runner._graphs.sizes_by_query_len.items()}
    vocab = int(parts.info.hf_config.vocab_size)
    tokenizer = parts.info.tokenizer
    if args.model and tokenizer is not None:
        chat = [{"role": "user", "content": EDIT + CODE}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompt = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    else:
        rng = random.Random(0)
        file_tokens = [rng.randrange(1000, vocab - 1) for _ in range(512)]
        prompt = file_tokens + [rng.randrange(1000, vocab - 1) for _ in range(16)] + file_tokens[:64]

    def run(name: str, speculator: Any) -> dict[str, Any]:
        runner.speculator = speculator
        single_stream(llm, prompt[:200], 16, f"{name}-warm")  # warm-up (triton autotune, allocator)
        reps = [single_stream(llm, prompt, args.out_len, f"{name}-{i}") for i in range(args.repeats)]
        row = {
            "tok_per_s": round(statistics.median(r["tok_per_s"] for r in reps), 1),
            "ttft_ms": round(statistics.median(r["ttft_ms"] for r in reps), 2),
            "acceptance_rate": reps[-1]["acceptance_rate"],
            "accepted_per_verification": reps[-1]["accepted_per_verification"],
            "tokens": reps[-1]["tokens"],
        }
        print(f"[{name}] {row['tok_per_s']} tok/s, acceptance {row['acceptance_rate']}, "
              f"accepted/verification {row['accepted_per_verification']}", flush=True)
        return row

    configs = result["configs"]
    configs["none"] = run("none", None)
    reference = configs["none"]["tokens"]

    def ctx(k: int) -> ProposerContext:
        spec = cfg.speculative.model_copy(update={"method": "ngram", "num_speculative_tokens": k})
        return ProposerContext(spec, cfg, llm.engine.pm, parts.device, parts.dtype, vocab, parts.max_model_len,
                               parts.block_size, parts.num_blocks)

    for k in (2, 4):
        configs[f"ngram k={k}"] = run(f"ngram-k{k}", Speculator(NgramProposer(ctx(k)), k, parts.max_model_len, vocab))
    for keep in (1.0, 0.6):
        proposer = ReplayProposer(reference, len(prompt), keep, vocab)
        configs[f"replay k=4 keep={keep}"] = run(f"replay-{keep}", Speculator(proposer, 4, parts.max_model_len, vocab))
    runner.speculator = None
    llm.shutdown()

    base = configs["none"]["tok_per_s"]
    lines = [f"{'config':<22}{'tok/s':>10}{'x plain':>9}{'accept':>9}{'acc/verif':>11}  same tokens"]
    for name, row in configs.items():
        acc = row["acceptance_rate"]
        apv = row["accepted_per_verification"]
        lines.append(f"{name:<22}{row['tok_per_s']:>10.1f}{row['tok_per_s'] / base:>9.2f}"
                     f"{'-' if acc is None else f'{acc:.1%}':>9}{'-' if apv is None else f'{apv:.2f}':>11}"
                     f"  {row['tokens'] == reference}")
        row["same_tokens_as_plain"] = row["tokens"] == reference
        del row["tokens"]
    result["table"] = "\n".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
