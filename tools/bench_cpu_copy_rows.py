"""A/B in one engine: from how many rows a GGUF model's kept bf16 / int8 copies take a product (kernels.py NOTE 6).

    python tools/bench_cpu_copy_rows.py [--batches 4,8,12,16] [--rounds 3] [--rows 8,16] [--model PATH]
                                        [--cpu-kernels int8]

Builds one engine (the embedded default model unless --model; its `cpu_kernels` as the CPU decides), then per
batch size runs the same greedy batch (32-128 random prompt ids, 64 output tokens, ignore_eos) with every
kernel's `direct_rows` set to each --rows value in turn, round after round (A B A B ...), so a neighbour's load
lands on both. Prints output tok/s and process CPU time per run, the ratio of the means, how many sequences
came out identical, and the load average. A batch of at least both thresholds is a control: it should read
1.00x. Benchmarks the shared 2-core machine only as well as its load allows: compare ratios, not rates.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.quantization.gguf.kernels import NativeKernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4,8,12,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="8,16", help="the two thresholds compared (A, B)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--cpu-kernels", default=None, help="the engine's cpu_kernels (default: its own choice)")
    args = ap.parse_args()
    a_rows, b_rows = (int(v) for v in args.rows.split(","))
    kw = {"cpu_kernels": args.cpu_kernels} if args.cpu_kernels else {}
    llm = LLM(args.model, **kw) if args.model else LLM(**kw)
    gc.unfreeze()  # the engine freezes what exists at its start; frozen objects are not in gc.get_objects()
    kernels = [o for o in gc.get_objects() if isinstance(o, NativeKernel) and (o.has_bf16_copy or o.has_int8_copy)]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, {len(kernels)} kernels with a kept copy, "
          f"loadavg {os.getloadavg()[0]:.2f}, {os.cpu_count()} cpus", flush=True)
    if not kernels:
        raise SystemExit("no kept bf16 / int8 copies (cpu_kernels is not bf16 / int8 here): nothing to compare")
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run(rows: int, prompts: list[dict[str, list[int]]]) -> tuple[float, float, list[tuple[int, ...]]]:
        for k in kernels:
            k.direct_rows = rows
        wall, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = [tuple(o.outputs[0].token_ids) for o in outs]
        return sum(map(len, tokens)) / wall, cpu, tokens

    for n in (int(v) for v in args.batches.split(",")):
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(32, 129))]}
                   for _ in range(n)]
        run(a_rows, prompts)  # warm-up
        rates: dict[int, list[float]] = {a_rows: [], b_rows: []}
        tokens: dict[int, list[tuple[int, ...]]] = {}
        for r in range(args.rounds):
            for rows in (a_rows, b_rows):
                rate, cpu, tokens[rows] = run(rows, prompts)
                rates[rows].append(rate)
                print(f"batch {n} round {r + 1} from {rows} rows: {rate:.1f} output tok/s, CPU {cpu:.2f} s, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
        same = sum(x == y for x, y in zip(tokens[a_rows], tokens[b_rows], strict=True))
        ma, mb = (sum(rates[k]) / len(rates[k]) for k in (a_rows, b_rows))
        print(f"batch {n}: from {a_rows} / from {b_rows} = {ma / mb:.3f}x ({ma:.1f} / {mb:.1f} output tok/s); "
              f"identical sequences {same}/{n}", flush=True)


if __name__ == "__main__":
    main()
