"""Decode attention at the batch shapes of W2 and W5 (H200): the triton kernel's configs and split factors.

    python examples/gpu/decode_sweep.py --out $OUT/decode_sweep.json      # H200, ~2 minutes

The kernel targets were tuned on 64 x 2048 (every request the same length). W2's decode steps hold ~500
requests of 128-1152 keys and W5's ~290 of 100-2048, where a split factor of 1 (the policy's choice: 8 KV
heads x 290 requests already fill the GPU) leaves the longest programs running alone at the end of the grid.
Each shape times the default (choose_config + choose_segments) and a grid of (segments, tile_n, warps,
stages), as CUDA-graph replays of 20 calls; TB/s counts each request's K/V bytes once.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fused_ops_bench import graph_us  # noqa: E402
from h200_check import paged_batch  # noqa: E402


def shapes(gen: torch.Generator) -> dict[str, list[int]]:
    def uniform(n: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    return {"64x2048": [2047] * 64, "W2 500 x U[128,1152]": uniform(500, 128, 1152),
            "W5 288 x U[100,2048]": uniform(288, 100, 2048), "W5 512 x U[100,2048]": uniform(512, 100, 2048)}


GRID = [(s, t, w, st) for s in (1, 2, 4, 8) for t in (16, 32, 64) for w in (2, 4, 8) for st in (2, 3, 4)
        if not (t == 64 and w == 2)]


def sweep_shape(ctx: list[int], gen: torch.Generator) -> dict[str, Any]:
    """The default and every GRID point on one batch of decodes with these context lengths."""
    from pagedllm.plugins.attention.triton_backend import choose_segments
    from pagedllm.plugins.attention.triton_kernels import unified_attention
    from pagedllm.plugins.attention.triton_tuning import AttentionConfig

    h, kvh, d, n = 32, 8, 128, len(ctx)
    b = paged_batch(ctx, [1] * n, h, kvh, d, 16, torch.bfloat16, gen, spare=0)
    c = b["common"]
    out_t = torch.empty_like(b["q"])
    kv_bytes = sum(x + 1 for x in ctx) * kvh * d * 2 * 2

    def run(segments: int, config: AttentionConfig | None) -> float:
        return graph_us(functools.partial(unified_attention, b["q"], b["cache"], out_t, c.query_start_loc,
                                          c.seq_lens, c.block_table, n, n, d**-0.5, num_segments=segments,
                                          config=config), calls=20)

    policy = choose_segments(n, kvh, torch.cuda.get_device_properties(0).multi_processor_count)
    default_us = run(policy, None)
    rows: list[dict[str, Any]] = []
    for segments, tile, warps, stages in GRID:
        row: dict[str, Any] = {"segments": segments, "tile_n": tile, "warps": warps, "stages": stages}
        try:
            us = run(segments, AttentionConfig(16, tile, warps, stages))
            row.update(us=round(us, 1), TBps=round(kv_bytes / (us * 1e-6) / 1e12, 3))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a data point
            row["error"] = str(exc)[:200]
        rows.append(row)
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    return {"requests": n, "kv_bytes": kv_bytes, "policy_segments": policy, "default_us": round(default_us, 1),
            "default_TBps": round(kv_bytes / (default_us * 1e-6) / 1e12, 3), "best": ok[:5], "all": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for name, ctx in shapes(gen).items():
        entry = sweep_shape(ctx, gen)
        result["shapes"][name] = entry
        print(f"{name}: default S={entry['policy_segments']} {entry['default_us']} us ({entry['default_TBps']} "
              "TB/s); best " + "; ".join(f"S={r['segments']} t{r['tile_n']} w{r['warps']} s{r['stages']} "
                                        f"{r['us']} us ({r['TBps']} TB/s)" for r in entry["best"][:3]), flush=True)
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
