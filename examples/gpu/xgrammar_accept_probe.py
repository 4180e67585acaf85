"""xgrammar's batch accept of 256 matchers alone, after a sleep and right after a batch fill, on this host.

    python examples/gpu/xgrammar_accept_probe.py TOKENIZER_DIR

The matchers walk bench_structured.py's JSON schema with random allowed tokens (paths computed first), so the
timed loop runs only xgrammar's calls. Prints, per variant, the accept's median ms over the steps and the
fill's (xgrammar's default threads, or one thread) where one runs between the accepts.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_structured import SCHEMA  # noqa: E402

N, STEPS, VOCAB = 256, 30, 49152
RAW_ACCEPT = xgr.base._core.BatchGrammarMatcher.batch_accept_token


def allowed_ids(row: torch.Tensor, stop_ids: set[int]) -> list[int]:
    words = row.numpy().view("uint32")
    ids = [w * 32 + b for w in range(len(words)) if words[w] for b in range(32) if words[w] >> b & 1]
    return [t for t in ids if t not in stop_ids] or ids


def token_paths(compiled: Any, stop_ids: set[int], bitmask: torch.Tensor) -> list[list[int]]:
    """STEPS batches of one random allowed token per matcher, each accepted by a walk from the start."""
    rng = random.Random(0)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(N)]
    fill = xgr.BatchGrammarMatcher()
    paths = []
    for _ in range(STEPS):
        fill.batch_fill_next_token_bitmask(matchers, bitmask, list(range(N)))
        tokens = [rng.choice(allowed_ids(bitmask[i], stop_ids)) for i in range(N)]
        assert all(RAW_ACCEPT([m._handle for m in matchers], tokens, False))
        paths.append(tokens)
    return paths


def timed(compiled: Any, paths: list[list[int]], bitmask: torch.Tensor,
          fill: Any | None) -> tuple[float, float | None]:
    """Median ms of the accept (and of the fill run between two accepts; a 2 ms sleep where `fill` is None)."""
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(N)]
    accepts, fills = [], []
    for tokens in paths:
        t = time.perf_counter()
        RAW_ACCEPT([m._handle for m in matchers], tokens, False)
        accepts.append(time.perf_counter() - t)
        if fill is None:
            time.sleep(0.002)
            continue
        t = time.perf_counter()
        fill.batch_fill_next_token_bitmask(matchers, bitmask, list(range(N)))
        fills.append(time.perf_counter() - t)
    fill_ms = round(1e3 * statistics.median(fills[3:]), 3) if fills else None
    return round(1e3 * statistics.median(accepts[3:]), 3), fill_ms


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    bitmask = torch.full((N, VOCAB // 32), -1, dtype=torch.int32)
    paths = token_paths(compiled, set(info.stop_token_ids), bitmask)
    print("paths ready", flush=True)
    variants = {"sleep": None, "fill": xgr.BatchGrammarMatcher(), "fill1": xgr.BatchGrammarMatcher(max_threads=1)}
    for name in ("sleep", "fill", "fill1", "sleep", "fill"):
        print(name, timed(compiled, paths, bitmask, variants[name]), flush=True)


if __name__ == "__main__":
    main()
