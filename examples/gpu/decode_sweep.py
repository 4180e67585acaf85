"""Decode and mixed attention at the batch shapes of W1, W2 and W5 (H200): the triton kernel's launch configs.

    python examples/gpu/decode_sweep.py --out $OUT/decode_sweep.json      # H200, ~4 minutes
    python examples/gpu/decode_sweep.py --quick --decode-only              # one segment, tiles 64 / 128: ~1 minute
    python examples/gpu/decode_sweep.py --quick --decode-only --heads-first  # each point in both launch orders

The kernel targets were tuned on 64 x 2048 (every request the same length). W2's decode steps hold ~500
requests of 128-1152 keys and W5's ~290 of 100-2048, where a split factor of 1 (the policy's choice: 8 KV
heads x 290 requests already fill the GPU) leaves the longest programs running alone at the end of the grid.
Each shape times the default (choose_config + choose_segments) and a grid of (segments, rows, tile_n, warps,
stages, reverse + K-as-rows), as CUDA-graph replays of 20 calls; TB/s counts each request's K/V bytes once
(for the mixed shapes of W1's and W5's prompt waves only the time means much).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fused_ops_bench import graph_us  # noqa: E402
from h200_check import paged_batch  # noqa: E402


def shapes(gen: torch.Generator) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (contexts, new tokens) per request, decodes first (as the engine orders a step)."""
    def uniform(n: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    w5_prompts = uniform(29, 100, 1024)
    return {
        "64x2048": ([2047] * 64, [1] * 64),
        "W2 500 x U[128,1152]": (uniform(500, 128, 1152), [1] * 500),
        # W2 itself: its 500 requests start together, so every step's contexts are equal -- 4,000 programs of
        # one length, 10.1 waves of three per SM: the last wave runs a tenth full (perf-notes §18f).
        "W2 lockstep 500 x 640": ([640] * 500, [1] * 500),
        "W2 lockstep 500 x 1100": ([1100] * 500, [1] * 500),
        "W5 288 x U[100,2048]": (uniform(288, 100, 2048), [1] * 288),
        "W5 512 x U[100,2048]": (uniform(512, 100, 2048), [1] * 512),
        # W1's mixed steps: 16 fresh 1024-token prompts beside ~500 decodes of 1024-1152 keys
        "W1 mixed 16 x 1024 + 496 decodes": (uniform(496, 1024, 1151) + [0] * 16, [1] * 496 + [1024] * 16),
        # W5's prompt waves at max_num_seqs 1024: ~16k new tokens of 100-1024-token prompts beside ~500 decodes
        "W5 mixed 29 prompts + 500 decodes": (uniform(500, 100, 2048) + [0] * 29, [1] * 500 + w5_prompts),
    }


# decode-only batches: (segments, rows, tile, warps, stages, reverse + K as rows); mixed: one segment, rows vary
DECODE_GRID = [(s, 16, t, w, st, False) for s in (1, 2) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
QUICK_GRID = [(1, 16, t, w, st, False) for t in (64, 128) for w in (4, 8) for st in (2, 3, 4)] + [
    (2, 16, 64, 4, 2, False), (2, 16, 128, 4, 3, False)]  # split in two: the lockstep shapes' last wave
MIXED_GRID = [(1, r, t, w, st, True) for r in (32, 64, 128) for t in (32, 64) for w in (4, 8) for st in (2, 3, 5)
              if not (r == 128 and w == 4)]


def sweep_shape(ctx: list[int], queries: list[int], gen: torch.Generator, quick: bool = False,
                orders: tuple[bool, ...] = (False,)) -> dict[str, Any]:
    """The default and every grid point on one step's batch (TB/s of K/V read for decode-only batches)."""
    from pagedllm.plugins.attention.triton.backend import choose_segments
    from pagedllm.plugins.attention.triton.kernels import unified_attention
    from pagedllm.plugins.attention.triton.tuning import AttentionConfig, choose_config

    h, kvh, d, n, tokens = 32, 8, 128, len(ctx), sum(queries)
    decode_only = tokens == n
    b = paged_batch(ctx, queries, h, kvh, d, 16, torch.bfloat16, gen, spare=0)
    c = b["common"]
    out_t = torch.empty_like(b["q"])
    kv_bytes = sum(x + q for x, q in zip(ctx, queries)) * kvh * d * 2 * 2

    def run(segments: int, config: AttentionConfig | None, search: bool = False) -> float:
        return graph_us(functools.partial(unified_attention, b["q"], b["cache"], out_t, c.query_start_loc,
                                          c.seq_lens, c.block_table, n, tokens, d**-0.5, num_segments=segments,
                                          config=config, search=search), calls=20)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    policy = choose_segments(n, kvh, sms) if decode_only else 1
    default_us = run(policy, None)
    # The default config on the searched upper-bound grid: what the decode-only launch saves (perf-notes §18f).
    search_us = run(policy, None, search=True) if decode_only else None
    rows: list[dict[str, Any]] = []
    grid = (QUICK_GRID if quick else DECODE_GRID) if decode_only else MIXED_GRID
    for (segments, block_m, tile, warps, stages, flags), heads_first in itertools.product(grid, orders):
        row: dict[str, Any] = {"segments": segments, "rows": block_m, "tile_n": tile, "warps": warps,
                               "stages": stages, "reverse_krows": flags, "heads_first": heads_first}
        try:
            us = run(segments, AttentionConfig(block_m, tile, warps, stages, reverse=flags, k_rows=flags,
                                               heads_first=heads_first))
            row.update(us=round(us, 1), TBps=round(kv_bytes / (us * 1e-6) / 1e12, 3))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a data point
            row["error"] = str(exc)[:200]
        rows.append(row)
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    return {"requests": n, "tokens": tokens, "kv_bytes": kv_bytes, "policy_segments": policy,
            "default_config": str(choose_config(tokens, n, policy)), "default_us": round(default_us, 1),
            "default_TBps": round(kv_bytes / (default_us * 1e-6) / 1e12, 3),
            "searched_grid_us": search_us and round(search_us, 1), "best": ok[:5], "all": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="decode shapes: one segment, 64 / 128-key tiles only")
    ap.add_argument("--decode-only", action="store_true", help="skip the mixed prompt-wave shapes")
    ap.add_argument("--heads-first", action="store_true",
                    help="time every grid point in both launch orders (triton_kernels' HEADS_FIRST)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, (ctx, queries) in shapes(gen).items():
        if args.decode_only and sum(queries) != len(ctx):
            continue
        entry = sweep_shape(ctx, queries, gen, args.quick, (False, True) if args.heads_first else (False,))
        result["shapes"][name] = entry
        best = "; ".join(f"S={r['segments']} r{r['rows']} t{r['tile_n']} w{r['warps']} s{r['stages']} "
                         f"{'rev ' if r['reverse_krows'] else ''}{'hf ' if r['heads_first'] else ''}"
                         f"{r['us']} us ({r['TBps']} TB/s)" for r in entry["best"][:3])
        print(f"{name}: default S={entry['policy_segments']} {entry['default_us']} us ({entry['default_TBps']} "
              f"TB/s; searched grid {entry['searched_grid_us']} us); best {best}", flush=True)
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
