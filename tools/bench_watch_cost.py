"""What the engine dashboard costs the engine: the same W2-like run with nobody watching and with a dashboard
open, alternated (A B A B), on the CPU.

    HF_HUB_OFFLINE=1 python tools/bench_watch_cost.py [--model PATH] [--requests 64] [--max-tokens 128] [--pairs 4]

A dashboard open is what the server does for a connected /ui/events client (plugins/server/ui/feed.py): the core
records every step (`EngineCore.set_watching(True)`) and a snapshot is taken twice a second
(`EngineCore.snapshot()`, which walks the block pool at most once a second). Nobody watching is the state of
every server without a dashboard client, and of `--no-ui`: the step then tests `watch is None`.

The engine is stepped here by hand (LLMEngine.step) so the snapshots come from the step loop, as the core
process takes them between steps. Two figures per mode: generated tokens per second of wall time (the best
run: the least disturbed by other processes on a shared machine) and per CPU second of this process (the
median: its own work, which other processes disturb much less). The load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def run(llm: Any, prompts: list[list[int]], max_tokens: int, watched: bool) -> tuple[float, float, int]:
    from pagedllm import SamplingParams

    engine = llm.engine
    engine.core.set_watching(watched)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{'w' if watched else 'u'}{time.monotonic_ns()}-{i}", {"prompt_token_ids": ids}, params)
    tokens, last_snapshot = 0, 0.0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        if watched and time.perf_counter() - last_snapshot >= 0.5:
            engine.core.snapshot()
            last_snapshot = time.perf_counter()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    engine.core.set_watching(False)
    return wall, cpu, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()

    import numpy as np

    from pagedllm import LLM

    llm = LLM(args.model, max_num_seqs=args.requests, num_threads=args.num_threads)
    vocab = int(llm.engine.parts.info.hf_config.vocab_size)
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(100, min(vocab, 32000), args.input_len)] for _ in range(args.requests)]
    run(llm, prompts[:8], 8, False)  # warm-up
    rates: dict[bool, list[float]] = {False: [], True: []}
    per_cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.pairs):
        for watched in (False, True):
            wall, cpu, tokens = run(llm, prompts, args.max_tokens, watched)
            rates[watched].append(tokens / wall)
            per_cpu[watched].append(tokens / cpu)
            print(f"{'dashboard open' if watched else 'nobody watching':15s}: {tokens} tokens in {wall:.2f} s "
                  f"({cpu:.2f} CPU s), load average {os.getloadavg()[0]:.1f}")
    best = {w: max(r) for w, r in rates.items()}
    med = {w: statistics.median(r) for w, r in per_cpu.items()}
    print(f"best tok/s: nobody watching {best[False]:.1f}, dashboard open {best[True]:.1f}, "
          f"open / not {best[True] / best[False]:.3f}")
    print(f"median tok per CPU s: nobody watching {med[False]:.1f}, dashboard open {med[True]:.1f}, "
          f"open / not {med[True] / med[False]:.3f}")


if __name__ == "__main__":
    main()
