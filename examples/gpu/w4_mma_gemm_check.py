"""The tensor-core W4A16 GEMM (plugins/quantization/w4a16/mma_gemm.py): correctness, then speed on the 8B shapes.

    python3 examples/gpu/w4_mma_gemm_check.py --out $OUT/w4_mma_gemm.json      # one H200, ~3-6 min

1. Correctness against x @ dequantize(...) in float32 (w4a16/layout.dequantize is the reference): rows 1..600
   (not multiples of the block's), bf16 and fp16, group 64 / 128 / one group per column, GPTQ v1 and v2 zero
   offsets, N = 192 / 320 and the 8B shapes, every tile shape the host can ask for, split-K 1..8 (a split
   launch twice must give the same bits). Max error over max |reference| must stay under the activation
   dtype's rounding (bf16 8e-3, fp16 1e-3) or the script exits non-zero.
2. Speed per (8B linear, M): bf16 F.linear (cuBLAS: what a bf16 model pays), the route w4a16_matmul runs
   today, dequantize + cuBLAS, the GEMM at gemm_tiles' choice and over a grid of tiles and splits (until
   --budget-s). Timing as w4_gemv_sweep.py: CUDA graphs of ~100 calls over rotating weight copies past L2.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_gemv_sweep import SHAPES_8B, Timer, err_of, make_weights  # noqa: E402

ROWS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)
# (wn, wm, tm, stages); splits are swept beside each
TILES = [(2, 2, 8, 4), (2, 2, 8, 3), (2, 1, 8, 4), (1, 2, 8, 4), (2, 4, 4, 3), (2, 2, 4, 4), (1, 1, 8, 4),
         (2, 1, 4, 4), (1, 4, 4, 4), (2, 4, 8, 3)]
SPLITS = (1, 2, 4, 8)


def check_one(n: int, k: int, m: int, dtype: torch.dtype, group: int, zero_offset: int,
              tiles: tuple[int, ...] | None) -> dict[str, Any]:
    from pagedllm.plugins.quantization.w4a16.layout import (
        PackedLayout,
        dequantize,
        pack_along_columns,
        pack_along_rows,
    )
    from pagedllm.plugins.quantization.w4a16.mma_gemm import gemm_reason, w4a16_mma_gemm

    g = group if group > 0 else k
    q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32)
    z = torch.randint(zero_offset, 16, (k // g, n), device="cuda", dtype=torch.int32)
    s = (torch.rand(k // g, n, device="cuda") * 0.02 + 0.001).to(dtype)
    layout = PackedLayout("gptq", 4, group, zero_offset)
    qw, qz = pack_along_rows(q, 4), pack_along_columns(z - zero_offset, 4)
    x = torch.randn(m, k, device="cuda").to(dtype)
    rec: dict[str, Any] = {"n": n, "k": k, "m": m, "dtype": str(dtype), "group": group, "zero_offset": zero_offset,
                           "tiles": list(tiles) if tiles else None}
    reason = gemm_reason(layout, x, s, qw, n)
    if reason:
        rec["refused"] = reason
        return rec
    ref = x.float() @ dequantize(PackedLayout("gptq", 4, g, zero_offset), qw, qz, s, dtype=torch.float32)
    y = w4a16_mma_gemm(x, layout, qw, qz, s, n, tiles)
    rec["err"] = err_of(y, ref)
    rec["same_bits_twice"] = bool(torch.equal(y, w4a16_mma_gemm(x, layout, qw, qz, s, n, tiles)))
    if rec["err"] > 0.05:  # where it goes wrong: rows / columns with large errors
        bad = (y.float() - ref).abs() > 0.05 * ref.abs().max()
        rec["bad_rows"] = bad.any(1).nonzero().flatten()[:16].tolist()
        rec["bad_cols"] = bad.any(0).nonzero().flatten()[:32].tolist()
        rec["bad_frac"] = float(bad.float().mean())
    return rec


def checks(out: dict[str, Any]) -> list[dict[str, Any]]:
    cases: list[tuple[tuple[int, int], int, torch.dtype, int, int, tuple[int, ...] | None]] = []
    for m in (1, 7, 16, 33, 64, 100, 129, 200, 600):
        for dt in (torch.bfloat16, torch.float16):
            for grp, zo in ((128, 1), (64, 0), (-1, 1)):
                cases.append(((192, 512), m, dt, grp, zo, None))
    for tiles in TILES:
        for split in (1, 2, 3, 8):
            for zfold in (0, 1) if tiles[2] == 4 else (0,):
                for m in (5, 77, 300):
                    n = 320 if tiles[0] == 1 else 384
                    cases.append(((n, 1024), m, torch.bfloat16, 128, 1, (*tiles, split, zfold)))
    for m in (33, 200):  # ZFOLD with both dtypes, groups and zero offsets
        for dt in (torch.bfloat16, torch.float16):
            for grp, zo in ((128, 1), (64, 0), (-1, 1)):
                cases.append(((192, 512), m, dt, grp, zo, (1, 1, 4, 4, 2, 1)))
    cases += [(shape, m, torch.bfloat16, 128, 1, None) for shape in SHAPES_8B.values() for m in (64, 256)]
    bad = []
    for (n, k), m, dtype, grp, zo, tiles in cases:
        rec = check_one(n, k, m, dtype, grp, zo, tiles)
        out["checks"].append(rec)
        bound = 8e-3 if dtype == torch.bfloat16 else 1e-3
        if "refused" in rec or rec["err"] > bound or not rec["same_bits_twice"]:
            bad.append(rec)
    errs = [r.get("err", 0.0) for r in out["checks"]]
    print(f"checks: {len(out['checks'])}, failed {len(bad)}; max err {max(errs):.2e}", flush=True)
    for r in bad[:12]:
        print("FAILED", json.dumps(r), flush=True)
    return bad


def speed(out: dict[str, Any], rows: tuple[int, ...], budget_s: float, t0: float) -> None:
    from pagedllm.plugins.quantization.w4a16.dequant import w4a16_dequant_matmul
    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_matmul, w4a16_route
    from pagedllm.plugins.quantization.w4a16.mma_gemm import GemmTiles, gemm_tiles, w4a16_mma_gemm

    timer = Timer(False)
    dtype = torch.bfloat16
    for name, (n, k) in SHAPES_8B.items():
        w = make_weights(n, k, "cuda", dtype, max(1, min(8, (256 << 20) // (n * k // 2))))
        lay = w["layout"]
        bf16 = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
                for _ in range(max(1, min(4, (256 << 20) // (2 * n * k))))]
        for m in rows:
            x = (torch.randn(m, k, device="cuda") * 0.5).to(dtype)
            ref = x.float() @ w["w_t"]
            row: dict[str, Any] = {"linear": name, "n": n, "k": k, "m": m, "route": w4a16_route(lay, m, None, n)}
            row["bf16_us"] = round(timer.us_per_call([functools.partial(F.linear, x, b) for b in bf16]), 2)
            row["route_us"] = round(timer.us_per_call(
                [functools.partial(w4a16_matmul, x, lay, *st, None, n) for st in w["sets"]]), 2)
            row["dequant_us"] = round(timer.us_per_call(
                [functools.partial(w4a16_dequant_matmul, x, lay, *st, None, n) for st in w["sets"]]), 2)
            default = gemm_tiles(m, n, k)
            row["default_tiles"] = list(default)
            row["gemm_us"] = round(timer.us_per_call(
                [functools.partial(w4a16_mma_gemm, x, lay, *st, n, default) for st in w["sets"]]), 2)
            row["gemm_err"] = err_of(w4a16_mma_gemm(x, lay, *w["sets"][0], n, default), ref)
            grid: dict[str, float] = {}
            for tiles, split, zfold in itertools.product(TILES, SPLITS, (0, 1)):
                if zfold and tiles[2] != 4:
                    continue
                if time.monotonic() - t0 > budget_s:
                    row["cut_by_budget"] = True
                    break
                t = GemmTiles(*tiles, split, zfold)
                if n % t.block_n or (split > 1 and k // 64 < 2 * split) or t.block_m > 2 * max(m, 32):
                    continue
                try:
                    grid[str(list(t))] = round(timer.us_per_call(
                        [functools.partial(w4a16_mma_gemm, x, lay, *st, n, t) for st in w["sets"]]), 2)
                except Exception as exc:  # noqa: BLE001 -- a config that does not launch is said, skipped
                    print(f"# {name} m={m} {t}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            if grid:
                best = min(grid, key=lambda c: grid[c])
                row["grid_best"], row["grid_best_us"], row["grid_tried"] = best, grid[best], len(grid)
                row["grid_top5"] = sorted(grid.items(), key=lambda kv: kv[1])[:5]
            row["route_over_gemm"] = round(row["route_us"] / row["gemm_us"], 3)
            row["bf16_over_gemm"] = round(row["bf16_us"] / row["gemm_us"], 3)
            print(f"{name} m={m} route {row['route']} {row['route_us']} dequant {row['dequant_us']} bf16 "
                  f"{row['bf16_us']} gemm {row['default_tiles']} {row['gemm_us']} best {row.get('grid_best')} "
                  f"{row.get('grid_best_us')}", flush=True)  # the whole row is in --out
            out["speed"].append(row)
        del w, bf16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="w4_mma_gemm.json")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--budget-s", type=float, default=300.0, help="the tile grid stops here")
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    torch.manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [],
                           "speed": [], "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    bad = [] if args.skip_checks else checks(out)
    try:
        speed(out, tuple(int(r) for r in args.rows.split(",")), args.budget_s, t0)
    finally:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
