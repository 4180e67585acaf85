"""Probe (issue 29): an in-register W4A16 GEMM for 16-2048 rows against the route the W4A16 method runs there.

    python3 examples/gpu/w4_gemm_probe.py --out $OUT/w4_gemm.json            # H200, ~4-6 min of GPU
    python examples/gpu/w4_gemm_probe.py --dry-run --out /tmp/w4_gemm.json   # CPU, Triton interpreter

Why: at 256 decode rows a GPTQ 8B step spends 4.6 ms dequantizing every weight into a 16-bit scratch for
cuBLAS (w4a16/dequant.py; docs/perf-notes.md section 32), about what the bf16 GEMMs themselves take; the
in-register GEMM of w4a16/kernel.py, which would read 4 bits a weight instead of writing and reading 16, was
measured at a quarter of cuBLAS's rate at 2048 rows. Two suspected costs, each a switch of the probe's kernel:
  DEQ   0: the method's unpacking (integer q - z, int -> float32 convert, multiply, round to 16 bits: two
           conversions a weight, which run at a sixteenth of the FMA rate); 2: the 16-bit "magic number" --
           OR the 4-bit code into the mantissa of 128.0 (bf16 0x4300, fp16 1024.0 0x6400), bitcast, subtract the
           zero the same way, multiply by the scale in 16 bits: no conversion instruction, the same value
           (q - z is exact; the one rounding is the product's, as the method's)
  LOAD  0: each packed word loaded once and broadcast to its 8 codes by a reshape (the method's GEMM); 1: each
           code loads its own word (8 loads of one address, served by L1; no layout change)
  SWAP  0: y = x @ W^T with the dequantized weight as tl.dot's second operand (on sm_90 wgmma reads that one
           from shared memory, so every dequantized tile goes through it); 1: y^T = W @ x^T, the weight the
           first operand, which wgmma can take from registers, and few rows fill the small side of the tile
Per (linear, M) it times bf16 cuBLAS (what a bf16 model pays), the method's route (w4a16_matmul: the GEMM
below 128 rows, dequantize + cuBLAS from 128), dequantize + cuBLAS alone, and the probe's grid of (DEQ, SWAP,
BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages); the best point's error against a float32 product of the
same dequantized weights. GPTQ order (what AWQ is repacked to at load), group 128, no act-order. A measurement
script, not an engine path: the method is unchanged.
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
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from w4_gemv_sweep import SHAPES_8B, Timer, err_of, make_weights  # noqa: E402

ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BUDGET_S = 420.0  # the grid stops taking new points here; the summary follows


@triton.jit
def _w4_probe_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                     GROUP: tl.constexpr, ZERO_OFFSET: tl.constexpr, DEQ: tl.constexpr, SWAP: tl.constexpr,
                     LOAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    PF: tl.constexpr = 8
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    dt = x_ptr.dtype.element_ty
    if dt == tl.bfloat16:
        MAGIC: tl.constexpr = 0x4300  # 128.0: a 4-bit code ORed into its mantissa reads 128 + q
    else:
        MAGIC: tl.constexpr = 0x6400  # float16 1024.0
    z_shift = (offs_n % PF) * 4
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_kw = k0 // PF + tl.arange(0, BLOCK_K // PF)
        g = k0 // GROUP
        zw = tl.load(qz_ptr + g * (N // PF) + offs_n // PF)
        z = ((zw >> z_shift) & 15) + ZERO_OFFSET
        s = tl.load(s_ptr + g * N + offs_n)
        if SWAP:
            x = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None], mask=m_ok[None, :], other=0.0)  # [BK, BM]
            if LOAD == 0:
                words = tl.load(qw_ptr + offs_kw[None, :] * N + offs_n[:, None])  # [BN, BK / 8]
                words = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_N, BLOCK_K // PF, PF)), (BLOCK_N, BLOCK_K))
            else:  # each code's own load of its word (8 loads of one address, served by L1): no reshape
                words = tl.load(qw_ptr + (offs_k // PF)[None, :] * N + offs_n[:, None])
            q = (words >> ((offs_k % PF) * 4)[None, :]) & 15
            zz, ss = z[:, None], s[:, None]
        else:
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
            if LOAD == 0:
                words = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :])  # [BK / 8, BN]
                words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // PF, PF, BLOCK_N)), (BLOCK_K, BLOCK_N))
            else:
                words = tl.load(qw_ptr + (offs_k // PF)[:, None] * N + offs_n[None, :])
            q = (words >> ((offs_k % PF) * 4)[:, None]) & 15
            zz, ss = z[None, :], s[None, :]
        if DEQ == 0:
            w = ((q - zz).to(tl.float32) * ss.to(tl.float32)).to(dt)
        else:
            qh = (q | MAGIC).to(tl.int16).to(dt, bitcast=True)
            zh = (zz | MAGIC).to(tl.int16).to(dt, bitcast=True)
            w = (qh - zh) * ss
        if SWAP:
            acc += tl.dot(w, x)
        else:
            acc += tl.dot(x, w)
    if SWAP:
        out = y_ptr + offs_m[None, :] * N + offs_n[:, None]
        ok = m_ok[None, :]
    else:
        out = y_ptr + offs_m[:, None] * N + offs_n[None, :]
        ok = m_ok[:, None]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)


Config = tuple[int, int, int, int, int, int, int, int, int]  # DEQ, SWAP, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, LOAD


def probe(x: torch.Tensor, qw: torch.Tensor, qz: torch.Tensor, s: torch.Tensor, cfg: Config,
          zero_offset: int) -> torch.Tensor:
    deq, swap, bm, bn, bk, split, warps, stages, load = cfg
    m, k = x.shape
    n = s.shape[1]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype) if split == 1 else torch.zeros(m, n, device=x.device)
    grid = (triton.cdiv(m, bm), n // bn, split)
    _w4_probe_kernel[grid](x, qw, qz, s, y, m, n, k, k // split, GROUP=128, ZERO_OFFSET=zero_offset, DEQ=deq,
                           SWAP=swap, LOAD=load, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                           num_warps=warps, num_stages=stages)
    return y if split == 1 else y.to(x.dtype)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). BLOCK_M is the rows' side of the tile either way (SWAP puts it
# in wgmma's N, which may be 16-256; without SWAP it is wgmma's M, 64 per warp group).
TILES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3),
         (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (64, 128, 128, 4, 3), (128, 128, 64, 8, 4),
         (256, 128, 64, 8, 3), (32, 128, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4),
         (16, 64, 128, 4, 4)]
LOADS = (1, 0)
STAGE1_ROWS = (256, 32)  # the whole grid; every other row count takes these rows' best few (KEEP)
KEEP = 8


def configs(m: int, n: int, k: int, dry: bool, among: list[Config] | None = None) -> list[Config]:
    """The grid's points valid for an [m, k] x [k, n] product (DEQ 2 only: DEQ 0 is timed at the best
    point), or those of `among` that are."""
    cand = among if among is not None else [
        (2, swap, bm, bn, bk, split, warps, stages, load) for load in LOADS for swap in (1, 0)
        for bm, bn, bk, warps, stages in TILES for split in (1, 2, 4)]
    out: list[Config] = []
    for cfg in cand:
        _, swap, bm, bn, bk, split, _, _, _ = cfg
        if (bm > max(16, triton.next_power_of_2(m)) and not (not swap and bm == 64)) or (not swap and bm < 64) or n % bn:
            continue
        tiles = triton.cdiv(m, bm) * (n // bn)
        if split > 1 and (tiles >= 66 or k % (bk * split) or (k // split) % 128):
            continue
        out.append(cfg)
    return out[:3] if dry else out


def point(timer: Timer, name: str, n: int, k: int, m: int, device: str, dtype: torch.dtype, dry: bool,
          cands: list[Config], t_start: float, budget_s: float) -> tuple[dict[str, Any], dict[Config, float]]:
    from pagedllm.plugins.quantization.w4a16.dequant import w4a16_dequant_matmul
    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_matmul, w4a16_route

    w = make_weights(n, k, device, dtype, 1 if dry else max(1, min(8, (256 << 20) // (n * k // 2))))
    lay = w["layout"]
    x = (torch.randn(m, k, device=device) * 0.5).to(dtype)
    ref = x.float() @ w["w_t"]
    row: dict[str, Any] = {"linear": name, "n": n, "k": k, "m": m, "route": w4a16_route(lay, m)}
    if not dry:
        bf16 = [torch.randn(n, k, device=device, dtype=dtype) * 0.02
                for _ in range(max(1, min(4, (256 << 20) // (2 * n * k))))]
        row["bf16_us"] = round(timer.us_per_call([lambda b=b: F.linear(x, b) for b in bf16]), 2)
        del bf16
        row["route_us"] = round(timer.us_per_call(
            [lambda st=st: w4a16_matmul(x, lay, *st, None, n) for st in w["sets"]]), 2)
        row["dequant_us"] = round(timer.us_per_call(
            [lambda st=st: w4a16_dequant_matmul(x, lay, *st, None, n) for st in w["sets"]]), 2)

    def time_cfg(cfg: Config) -> float | None:
        fns: list[Callable[[], torch.Tensor]] = [lambda st=st: probe(x, *st, cfg, lay.zero_offset) for st in w["sets"]]
        try:
            return timer.us_per_call(fns)
        except Exception as exc:  # a point that does not compile (shared memory, registers): said, skipped
            print(f"# {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return None

    times: dict[Config, float] = {}
    for cfg in cands:
        if time.monotonic() - t_start > budget_s:
            row["cut_by_budget"] = True
            break
        us = time_cfg(cfg)
        if us is not None:
            times[cfg] = us
    if times:
        best = min(times, key=lambda c: times[c])
        row["probe_us"], row["probe_cfg"], row["probe_tried"] = round(times[best], 2), list(best), len(times)
        row["probe_err"] = err_of(probe(x, *w["sets"][0], best, lay.zero_offset), ref)
        deq0 = time_cfg((0,) + best[1:])
        row["deq0_us"] = round(deq0, 2) if deq0 is not None else None
        if "route_us" in row:
            row["route_over_probe"] = round(row["route_us"] / times[best], 3)
            row["bf16_over_probe"] = round(row["bf16_us"] / times[best], 3)
    row["route_err"] = err_of(w4a16_matmul(x, lay, *w["sets"][0], None, n), ref)
    return row, times


Measure = Callable[[str, int, int, int, "list[Any] | None"], "tuple[dict[str, Any], dict[Any, float]]"]


def staged_sweep(rows: tuple[int, ...], stage1: list[int], linears: dict[str, tuple[int, int]],
                 measure: Measure) -> list[dict[str, Any]]:
    """Stage 1: the whole grid (`measure(name, n, k, m, None)`) at the `stage1` rows; then every other row count
    tries the KEEP configs that did best (summed time over the linears, each relative to its best) at the
    nearer of them. Prints and returns each (linear, M)'s row."""
    points: list[dict[str, Any]] = []
    ranked: dict[int, list[Any]] = {}
    for m in stage1 + [r for r in rows if r not in stage1]:
        rep = min(ranked, key=lambda r: abs(r - m) / min(r, m), default=None) if m not in stage1 else None
        per_cfg: dict[Any, tuple[int, float]] = {}  # (linears timed, summed time relative to each best)
        for name, (n, k) in linears.items():
            row, times = measure(name, n, k, m, ranked[rep] if rep is not None else None)
            best_us = min(times.values(), default=0.0)
            for cfg, us in times.items():
                seen, total = per_cfg.get(cfg, (0, 0.0))
                per_cfg[cfg] = (seen + 1, total + us / best_us)
            print(json.dumps(row), flush=True)
            points.append(row)
        if m in stage1:
            ranked[m] = sorted(per_cfg, key=lambda c: (-per_cfg[c][0], per_cfg[c][1]))[:KEEP]
    return points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: the paths run")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--stage1-rows", default=",".join(map(str, STAGE1_ROWS)))
    ap.add_argument("--tiles", default=None, help="BM:BN:BK:warps:stages,... (default: TILES)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    args = ap.parse_args()
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float16 if dry else torch.bfloat16
    timer = Timer(dry)
    linears = {"tiny": (256, 256)} if dry else SHAPES_8B
    rows = (16, 64) if dry else tuple(int(r) for r in args.rows.split(","))
    t_start = time.monotonic()
    if args.tiles:
        TILES[:] = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")]  # type: ignore[misc]
    stage1_rows = tuple(int(r) for r in args.stage1_rows.split(","))
    stage1 = [m for m in stage1_rows if m in rows] if not dry else list(rows)
    points = staged_sweep(rows, stage1, linears, lambda name, n, k, m, among: point(
        timer, name, n, k, m, device, dtype, dry, configs(m, n, k, dry, among), t_start, args.budget_s))
    with open(args.out, "w") as f:
        json.dump({"rows": points, "device": "cpu" if dry else torch.cuda.get_device_name(),
                   "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
