"""Does xgrammar's accept_token / fill run in parallel on threads? Serial vs a thread pool, 256 matchers.

    python examples/gpu/xgrammar_threads_probe.py --tokenizer DIR [--threads 1,2,4,8]

The matchers walk the JSON schema of bench_structured.py with random allowed tokens; per step the probe times
256 accept_token calls and 256 bitmask fills one by one, then split over N threads. If the time drops with
N, the call releases the GIL and a batch can be accepted in parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_structured import SCHEMA  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--matchers", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=128256)
    compiled = xgr.GrammarCompiler(info).compile_grammar(
        xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    n = args.matchers
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(n)]
    bitmask = xgr.allocate_token_bitmask(n, 128256)
    shifts = torch.arange(32, dtype=torch.int32)
    rng = random.Random(0)
    pools = {k: ThreadPoolExecutor(k) for k in map(int, args.threads.split(","))}
    times: dict[str, list[float]] = {}

    def run(label: str, fn, k: int) -> None:  # noqa: ANN001
        chunks = [range(i, min(i + (n + k - 1) // k, n)) for i in range(0, n, (n + k - 1) // k)]
        t0 = time.perf_counter()
        if k == 1:
            fn(range(n))
        else:
            list(pools[k].map(fn, chunks))
        times.setdefault(f"{label} x{k}", []).append(time.perf_counter() - t0)

    for _ in range(args.steps):
        for k in pools:
            run("fill", lambda rows: [matchers[i].fill_next_token_bitmask(bitmask, i) for i in rows], k)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :128256]
        tokens = []
        for i in range(n):
            allowed = bits[i].nonzero().flatten()
            tokens.append(int(allowed[rng.randrange(len(allowed))]))
        for k in pools:
            run("accept", lambda rows, tokens=tokens: [matchers[i].accept_token(tokens[i]) for i in rows], k)
            for m in matchers:
                m.rollback(1)
        for m, t in zip(matchers, tokens):
            m.accept_token(t)
    for label, ts in times.items():
        ts = sorted(ts)
        print(f"{label:12s} median {ts[len(ts) // 2] * 1e3:7.2f} ms for {n} matchers "
              f"({ts[len(ts) // 2] / n * 1e6:.1f} us each)")


if __name__ == "__main__":
    main()
