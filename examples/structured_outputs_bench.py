"""Structured-output overhead on the CPU: output tok/s with and without a JSON schema, same requests.

    HF_HUB_OFFLINE=1 python examples/structured_outputs_bench.py [--model PATH] [--requests 32] [--repeats 3]

Each run sends `--requests` chat prompts at once to the offline engine (the embedded SmolLM2 by default): once
free (ignore_eos, max_tokens fixed, so every request decodes the same number of tokens), once constrained by a
JSON schema (also ignore_eos: the request ends when its grammar does, or at max_tokens). Output tok/s is the
generated tokens over the wall time of that generate() call; runs alternate free / schema so a machine's
drift hits both, after one warm-up of each (the grammar's compilation is in the warm-up, reported apart).

On a shared machine wall times of the same run differ by 2-5x (other processes take the cores), so two
figures are printed: the ratio of the best runs (the least disturbed of each), and the ratio of the medians
of tokens per CPU second of this process (its own work: `time.process_time()`, one torch thread by default),
which other processes disturb much less.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "interests": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "city", "interests", "role"],
    "additionalProperties": False,
}
TOPICS = ["a chef", "a pilot", "a student", "a painter", "a nurse", "a farmer", "a coder", "a singer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default=None, help="structured-output backend (default: selected per schema)")
    ap.add_argument("--num-threads", type=int, default=1, help="torch CPU threads (1: CPU time = work)")
    args = ap.parse_args()

    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, max_num_seqs=max(args.requests, 1), num_threads=args.num_threads)
    conversations = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON."}]
                     for i in range(args.requests)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, backend=args.backend))

    def run(params: SamplingParams) -> tuple[float, int, list[Any], float]:
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.chat(conversations, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return wall, sum(len(o.outputs[0].token_ids) for o in outs), outs, cpu

    warm_free = run(free)
    warm_schema = run(schema)
    print(f"warm-up: free {warm_free[0]:.2f} s, schema {warm_schema[0]:.2f} s (compiles the grammar)")
    rates: dict[str, list[float]] = {"free": [], "schema": []}
    per_cpu: dict[str, list[float]] = {"free": [], "schema": []}
    for _ in range(args.repeats):
        for name, params in (("free", free), ("schema", schema)):
            wall, tokens, outs, cpu = run(params)
            rates[name].append(tokens / wall)
            per_cpu[name].append(tokens / cpu)
            print(f"{name:6s}: {tokens} output tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s "
                  f"({cpu:.2f} CPU s: {tokens / cpu:.1f} tok per CPU s)")
    finished = sum(o.outputs[0].finish_reason == "stop" for o in warm_schema[2])
    print(f"schema outputs that finished their grammar: {finished}/{args.requests}; "
          f"e.g. {warm_schema[2][0].outputs[0].text[:120]!r}")
    best_free, best_schema = max(rates["free"]), max(rates["schema"])
    cpu_free, cpu_schema = statistics.median(per_cpu["free"]), statistics.median(per_cpu["schema"])
    print(f"best output tok/s: free {best_free:.1f}, schema {best_schema:.1f}; ratio schema/free = "
          f"{best_schema / best_free:.3f}")
    print(f"median tok per CPU s: free {cpu_free:.1f}, schema {cpu_schema:.1f}; ratio schema/free = "
          f"{cpu_schema / cpu_free:.3f}")


if __name__ == "__main__":
    main()
