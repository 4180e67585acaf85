"""Probe (issue 29): an FP8 W8A8 Triton GEMM (e4m3 x e4m3, row scales) for 4-512 rows against the FP8 method's route.

    python3 examples/gpu/fp8_w8a8_probe.py --out $OUT/fp8_w8a8.json            # H200, ~3-5 min of GPU
    python examples/gpu/fp8_w8a8_probe.py --dry-run --out /tmp/fp8_w8a8.json   # CPU, Triton interpreter

Why: from 3 rows the FP8 method quantizes x per token and calls torch._scaled_mm (cuBLASLt), which on the H200
takes one 128 x 128 tile at every M: a 4096-column output gets 32 blocks for 132 SMs, and o / down run slower
than bf16 cuBLAS at 4-256 rows (docs/perf-notes.md section 32). vLLM's CUTLASS FP8 GEMM picks its tile by M.
The kernel of plugins/quantization/fp8/gemm.py runs the same math -- e4m3 activations with per-token scales
against e4m3 weights with per-channel scales, float32 accumulation in tl.dot (wgmma's FP8 mode on sm_90),
both scales applied in the epilogue -- and the probe times it over a grid of (SWAP, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages). SWAP 1 computes y^T = W @ x^T so few
rows fill the small side of the tile (the swap-AB of CUTLASS's small-M configs). Each time includes the
method's per-token quantization of x (one launch, fp8/kernel.py), as the route's does. Per (linear, M): bf16
cuBLAS, the route (quantization + _scaled_mm), the probe's best point and its error against a float32
product of the same quantized operands. The method's rule (fp8/gemm.py NOTE 1, 2) came from this grid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
from fp8_gemm_check import LINEARS, quantized  # noqa: E402
from w4_gemm_probe import staged_sweep  # noqa: E402
from w4_gemv_sweep import Timer, err_of  # noqa: E402

ROWS = (4, 8, 16, 32, 64, 128, 256, 512)
BUDGET_S = 230.0  # the grid stops taking new points here; the summary follows


Config = tuple[int, int, int, int, int, int, int]  # Fp8GemmBlocks' order: SWAP, BM, BN, BK, SPLIT_K, warps, stages


def probe(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, cfg: Config, quant: Callable[..., Any]) -> torch.Tensor:
    """The method's quantization of x, then fp8/gemm.py's kernel at the point `cfg`."""
    from pagedllm.plugins.quantization.fp8.gemm import Fp8GemmBlocks, fp8_gemm

    xq, a = quant(x)
    return fp8_gemm(xq, a, wq, ws, x.dtype, blocks=Fp8GemmBlocks(*cfg))


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); BLOCK_M is the rows' side of the tile either way
TILES = [(16, 64, 256, 4, 4), (16, 128, 256, 4, 4), (32, 64, 256, 4, 4), (32, 128, 256, 4, 4),
         (64, 64, 256, 4, 4), (64, 128, 128, 4, 4), (64, 128, 256, 4, 3), (128, 128, 128, 8, 3),
         (128, 128, 128, 4, 4), (128, 256, 128, 8, 3), (64, 256, 128, 8, 3), (256, 128, 128, 8, 3)]
STAGE1_ROWS = (256, 16)  # the whole grid; every other row count takes these rows' best few (KEEP)
KEEP = 8


def configs(m: int, n: int, k: int, dry: bool, among: list[Config] | None = None) -> list[Config]:
    """The grid's points valid for an [m, k] x [k, n] product, or those of `among` that are."""
    cand = among if among is not None else [
        (swap, bm, bn, bk, split, warps, stages) for swap in (1, 0) for bm, bn, bk, warps, stages in TILES
        for split in (1, 2, 4)]
    out: list[Config] = []
    for cfg in cand:
        swap, bm, bn, bk, split, _, _ = cfg
        if (bm > max(16, triton.next_power_of_2(m)) and not (not swap and bm == 64)) or (not swap and bm < 64) or n % bn:
            continue
        tiles = triton.cdiv(m, bm) * (n // bn)
        if split > 1 and (tiles >= 66 or k % (bk * split)):
            continue
        out.append(cfg)
    return out[:2] if dry else out


def point(timer: Timer, name: str, n: int, k: int, m: int, device: str, dry: bool,
          cands: list[Config], t_start: float) -> tuple[dict[str, Any], dict[Config, float]]:
    from pagedllm.plugins.quantization.fp8.method import quantize_activations, quantize_activations_torch

    quant = quantize_activations_torch if dry else quantize_activations
    ws = quantized(n, k, device, 1 if dry else max(1, min(8, (256 << 20) // (n * k))))
    x = (torch.randn(m, k, device=device) * 0.5).to(torch.float16 if dry else torch.bfloat16)
    xq, a = quant(x)
    ref = (xq.float() * a) @ (ws[0]["q_row"].float() * ws[0]["s_row"].float()[:, None]).t()
    row: dict[str, Any] = {"linear": name, "n": n, "k": k, "m": m}
    if not dry:
        def rowwise(w: dict[str, torch.Tensor]) -> torch.Tensor:
            x_q, s = quant(x)
            return torch._scaled_mm(x_q, w["q_row"].t(), scale_a=s, scale_b=w["s_row"].unsqueeze(0),
                                    out_dtype=torch.bfloat16)

        row["bf16_us"] = round(timer.us_per_call([lambda w=w: F.linear(x, w["bf16"]) for w in ws]), 2)
        row["route_us"] = round(timer.us_per_call([lambda w=w: rowwise(w) for w in ws]), 2)
        row["route_err"] = err_of(rowwise(ws[0]), ref)
    times: dict[Config, float] = {}
    for cfg in cands:
        if time.monotonic() - t_start > BUDGET_S:
            row["cut_by_budget"] = True
            break
        fns: list[Callable[[], torch.Tensor]] = [
            lambda w=w, c=cfg: probe(x, w["q_row"], w["s_row"], c, quant) for w in ws]
        try:
            times[cfg] = timer.us_per_call(fns)
        except Exception as exc:  # a point that does not compile (shared memory, registers): said, skipped
            print(f"# {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    if times:
        best = min(times, key=lambda c: times[c])
        row["probe_us"], row["probe_cfg"], row["probe_tried"] = round(times[best], 2), list(best), len(times)
        row["probe_err"] = err_of(probe(x, ws[0]["q_row"], ws[0]["s_row"], best, quant), ref)
        if "route_us" in row:
            row["route_over_probe"] = round(row["route_us"] / times[best], 3)
            row["bf16_over_probe"] = round(row["bf16_us"] / times[best], 3)
    return row, times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: the paths run")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = ap.parse_args()
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    timer = Timer(dry)
    linears = {"tiny": (256, 512)} if dry else LINEARS
    rows = (16, 64) if dry else tuple(int(r) for r in args.rows.split(","))
    t_start = time.monotonic()
    stage1 = [m for m in STAGE1_ROWS if m in rows] if not dry else list(rows)
    points = staged_sweep(rows, stage1, linears, lambda name, n, k, m, among: point(
        timer, name, n, k, m, device, dry, configs(m, n, k, dry, among), t_start))
    with open(args.out, "w") as f:
        json.dump({"rows": points, "device": "cpu" if dry else torch.cuda.get_device_name(),
                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
