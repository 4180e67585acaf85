"""The W4A16 decode GEMV variants on the Llama-3.1-8B layer shapes: time, weight bandwidth, error; one H200.

    python examples/gpu/w4_gemv_sweep.py --out $OUT/w4_gemv_sweep.json        # H200, < 150 s
    python examples/gpu/w4_gemv_sweep.py --dry-run --out /tmp/w4_sweep.json   # CPU, Triton interpreter

Variants: "base" (plugins/quantization/w4a16/gemv.py, split-K summed by a second kernel), the
TILED_VARIANTS of w4a16/gemv_tiled.py (tile, tile_pf, mant, mant_pf: word tiles in flight, split-K summed in
the kernel). Shapes qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, GPTQ v1 packing, group
128, random codes, bf16 activations and scales. (A K-major repacking and a row-wise variant were measured
slower and removed: docs/perf-notes.md §14.)

  1. M = 1: every variant x its (BLOCK_N, BLOCK_K, warps) grid x SPLIT_K for ~8 / 4 / 16 programs per SM (--per-sm), per
     shape; the variants' defaults first, so a run cut short by the time budget still covers them all
  2. M = 2 and 4: base and the two best variants of stage 1, at their default blocks
Timing: a CUDA graph of ~100 calls, replayed 5 times between CUDA events (median), rotating over copies of
the weight that together exceed 256 MB, so every call reads its weight from HBM as a decode step does (one
copy of qkv, 12.6 MB, would stay in the 50 MB L2). bf16 F.linear is timed the same way. Error: max |y - ref|
/ max |ref| against x @ (dequantized weight) in float32; split-K variants are also run twice and their bits
compared (the in-kernel sum is meant to be deterministic).
--dry-run: tiny shapes, float16, Triton interpreter, one call per point (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SHAPES_TINY = {"qkv": (192, 256), "o": (128, 256), "gate_up": (320, 256), "down": (128, 384)}
GROUP = 128
SMS = 132
ROTATE_BYTES = 256 << 20
BUDGET_S = 95.0  # stage 1 stops taking new points here (compiles dominate); stage 2 and the summary follow
HARD_S = 130.0  # stage 2 stops taking new points here
# (BLOCK_N, BLOCK_K, warps); the first of each is its default (tiled_blocks), timed before the rest
GRID: dict[str, list[tuple[int, int, int]]] = {
    "base": [(256, 128, 2), (128, 64, 1), (128, 128, 1)],
    "tile": [(256, 64, 1), (128, 128, 1), (128, 64, 1), (256, 128, 2)],
    "tile_pf": [(128, 64, 1), (256, 64, 2)],  # (128, 128, 1) and (256, 64, 1) spill on sm_90
    "mant": [(256, 64, 1), (128, 128, 1), (128, 64, 1), (256, 128, 2)],
    "mant_pf": [(256, 64, 1), (128, 64, 1), (256, 64, 2)],
}
PROGRAMS_PER_SM = (8, 4, 16)


def split_for(n: int, k: int, block_n: int, block_k: int, per_sm: int) -> int:
    return max(1, min(math.ceil(SMS * per_sm / math.ceil(n / block_n)), k // block_k))


def make_weights(n: int, k: int, device: str, dtype: torch.dtype, copies: int) -> dict[str, Any]:
    """GPTQ v1 packing of random codes (as quant_bench.make_packed), `copies` clones, and the float32 W^T."""
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout, pack_along_columns, pack_along_rows

    q = torch.randint(0, 16, (k, n), device=device, dtype=torch.int32)
    z = torch.randint(1, 16, (k // GROUP, n), device=device, dtype=torch.int32)
    s = (torch.rand(k // GROUP, n, device=device) * 0.02 + 0.001).to(dtype)
    qweight, qzeros = pack_along_rows(q, 4), pack_along_columns(z - 1, 4)
    w_t = (q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0)
    del q, z
    sets = [(qweight, qzeros, s)] + [(qweight.clone(), qzeros.clone(), s.clone()) for _ in range(copies - 1)]
    nbytes = qweight.nbytes + qzeros.nbytes + s.nbytes
    layout = PackedLayout("gptq", 4, GROUP, zero_offset=1)
    return dict(layout=layout, sets=sets, w_t=w_t, bytes=nbytes, n=n)


class Timer:
    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run

    def us_per_call(self, fns: list[Callable[[], Any]]) -> float:
        """Mean µs of one call, over CUDA-graph replays of ~100 calls cycling through `fns` (one per copy)."""
        if self.dry_run:  # the interpreter: one call, to prove the path runs (not a speed)
            t0 = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - t0) * 1e6
        for f in fns:  # compile and allocate outside the capture
            f()
        torch.cuda.synchronize()
        rounds = max(1, math.ceil(100 / len(fns)))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(rounds):
                for f in fns:
                    f()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / (rounds * len(fns)))
        del graph
        return statistics.median(times)


def w4_fns(w: dict[str, Any], x: torch.Tensor, variant: str, blocks: tuple[int, int, int, int] | None
           ) -> list[Callable[[], torch.Tensor]]:
    from pagedllm.plugins.quantization.w4a16.gemv import w4a16_gemv

    def call(qw: torch.Tensor, qz: torch.Tensor, s: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: w4a16_gemv(x, w["layout"], qw, qz, s, w["n"], blocks=blocks, variant=variant)

    return [call(*st) for st in w["sets"]]


def err_of(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def point(ctx: dict[str, Any], w: dict[str, Any], x: torch.Tensor, ref: torch.Tensor, variant: str,
          blocks: tuple[int, int, int, int] | None) -> dict[str, Any]:
    from pagedllm.plugins.quantization.w4a16.gemv import gemv_blocks
    from pagedllm.plugins.quantization.w4a16.gemv_tiled import tiled_blocks, tiled_reason

    m, k = x.shape
    if blocks is None:
        tiled = variant != "base" and tiled_reason(variant, w["layout"], m) is None
        blocks = tuple(tiled_blocks(variant, w["layout"], m, w["n"], k) if tiled  # type: ignore[assignment]
                       else gemv_blocks(w["layout"], m, w["n"], k))
    fns = w4_fns(w, x, variant, blocks)
    rec: dict[str, Any] = {"variant": variant, "m": m, "blocks": list(blocks or ())}
    try:
        y = fns[0]()
        rec["err"] = err_of(y, ref)
        if blocks and blocks[3] > 1:
            rec["same_bits_twice"] = bool(torch.equal(y, fns[0]()))
        rec["us"] = ctx["timer"].us_per_call(fns)
    except Exception as exc:  # a config the compiler or the kernel refuses: recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return rec
    moved = w["bytes"] + x.nbytes + m * w["n"] * x.element_size()
    rec["tb_s"] = moved / rec["us"] / 1e6
    return rec


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.plugins.quantization.w4a16.gemv_tiled import TILED_VARIANTS

    dry = args.dry_run
    device, dtype = ("cpu", torch.float16) if dry else ("cuda", torch.bfloat16)
    shapes = SHAPES_TINY if dry else SHAPES_8B
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - {"base", *TILED_VARIANTS})
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown} (base, {', '.join(TILED_VARIANTS)})")
    grid = {v: GRID[v][:1] for v in variants} if dry else GRID
    per_sm = [int(p) for p in args.per_sm.split(",")]
    per_sm = per_sm[:1] if dry else per_sm
    ctx = {"timer": Timer(dry)}
    t_start = time.time()
    out: dict[str, Any] = {"device": "cpu (interpreter)" if dry else torch.cuda.get_device_name(),
                           "torch": torch.__version__, "points": [], "bf16_us": {}, "skipped": 0}
    torch.manual_seed(0)
    weights, xs, refs = {}, {}, {}
    for name, (n, k) in shapes.items():
        packed_bytes = n * k // 2 + n * k // GROUP * 5 // 2
        weights[name] = make_weights(n, k, device, dtype, 1 if dry else math.ceil(ROTATE_BYTES / packed_bytes))
        xs[name] = {m: torch.randn(m, k, device=device).to(dtype) for m in (1, 2, 4)}
        refs[name] = {m: xs[name][m].float() @ weights[name]["w_t"] for m in (1, 2, 4)}
        del weights[name]["w_t"]
        if not dry:  # bf16 F.linear over rotating copies
            w16 = (torch.randn(n, k, device=device) * 0.02).to(dtype)
            ws = [w16] + [w16.clone() for _ in range(math.ceil(ROTATE_BYTES / w16.nbytes) - 1)]
            x1 = xs[name][1]
            out["bf16_us"][name] = ctx["timer"].us_per_call([functools.partial(F.linear, x1, w) for w in ws])
            del ws, w16
    # stage 1: M = 1; pass 0 = each variant's first point at the middle split, then the rest of the grid
    order = []
    for pass_ in (0, 1):
        for v in variants:
            for gi, (bn, bk, warps) in enumerate(grid[v]):
                for si, ps in enumerate(per_sm):
                    if (gi == 0 and si == 0) == (pass_ == 0):
                        order.append((v, bn, bk, warps, ps))
    for v, bn, bk, warps, ps in order:
        if time.time() - t_start > (BUDGET_S if not dry else 1e9):
            out["skipped"] += 1
            continue
        for name, (n, k) in shapes.items():
            blocks = (bn, bk, warps, split_for(n, k, bn, bk, ps))
            rec = point(ctx, weights[name], xs[name][1], refs[name][1], v, blocks)
            rec["shape"] = name
            out["points"].append(rec)
            if not dry:
                torch.cuda.synchronize()
    out["stage1_s"] = time.time() - t_start
    best = summarize(out, shapes)
    # stage 2: M = 2, 4 for base and the two fastest tiled variants, at their default blocks
    ranked = sorted((v for v in best if v != "base" and best[v]["layer_us"] is not None),
                    key=lambda v: best[v]["layer_us"])
    for v in [*(["base"] if "base" in variants else []), *ranked[:2]]:
        for m in (2, 4):
            for name in shapes:
                if time.time() - t_start > (HARD_S if not dry else 1e9):
                    out["skipped"] += 1
                    continue
                rec = point(ctx, weights[name], xs[name][m], refs[name][m], v, None)
                rec["shape"] = name
                out["points"].append(rec)
    out["total_s"] = time.time() - t_start
    out["summary"] = summarize(out, shapes)
    return out


def summarize(out: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Per variant and M: the fastest point per shape, the layer's sum, its speed-up over bf16, worst error."""
    summary: dict[str, Any] = {}
    for rec in out["points"]:
        if "us" not in rec:
            continue
        key = rec["variant"] if rec["m"] == 1 else f"{rec['variant']}@m{rec['m']}"
        row = summary.setdefault(key, {"shapes": {}, "max_err": 0.0})
        cur = row["shapes"].get(rec["shape"])
        if cur is None or rec["us"] < cur["us"]:
            row["shapes"][rec["shape"]] = {k: rec[k] for k in ("us", "tb_s", "blocks", "err")}
        row["max_err"] = max(row["max_err"], rec["err"])
        row["nondeterministic"] = row.get("nondeterministic", False) or rec.get("same_bits_twice") is False
    bf16 = sum(out["bf16_us"].values()) if len(out["bf16_us"]) == len(shapes) else None
    for row in summary.values():
        full = len(row["shapes"]) == len(shapes)
        row["layer_us"] = sum(s["us"] for s in row["shapes"].values()) if full else None
        row["x_bf16"] = bf16 / row["layer_us"] if bf16 and row["layer_us"] else None
    return summary


def print_table(out: dict[str, Any]) -> None:
    bf16 = out["bf16_us"]
    if bf16:
        print("bf16 F.linear µs: " + ", ".join(f"{k} {v:.1f}" for k, v in bf16.items())
              + f" | layer {sum(bf16.values()):.1f}")
    print(f"{'variant':<14}{'layer µs':>9}{'x bf16':>7}{'max err':>9}  per shape: µs (TB/s) [BN, BK, warps, split]")
    for v, row in out["summary"].items():
        cells = " | ".join(f"{s} {r['us']:.1f} ({r['tb_s']:.2f}) {r['blocks']}" for s, r in row["shapes"].items())
        layer = f"{row['layer_us']:.1f}" if row["layer_us"] else "-"
        speed = f"{row['x_bf16']:.2f}" if row["x_bf16"] else "-"
        flag = " NONDETERMINISTIC" if row.get("nondeterministic") else ""
        print(f"{v:<14}{layer:>9}{speed:>7}{row['max_err']:>9.1e}  {cells}{flag}")
    failed = [p for p in out["points"] if "error" in p]
    print(f"points {len(out['points'])}, failed {len(failed)}, skipped for time {out['skipped']}, "
          f"total {out['total_s']:.0f} s")
    for p in failed[:5]:
        print("  failed:", p["variant"], p["shape"], p["blocks"], p["error"][:160])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON path (e.g. $OUT/w4_gemv_sweep.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--variants", default="base,tile,tile_pf,mant,mant_pf",
                        help="comma-separated variants to sweep (base and TILED_VARIANTS)")
    parser.add_argument("--per-sm", default=",".join(map(str, PROGRAMS_PER_SM)),
                        help="programs per SM the split-K choices aim at, the first one timed first")
    args = parser.parse_args()
    out = run(args)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print_table(out)


if __name__ == "__main__":
    main()
