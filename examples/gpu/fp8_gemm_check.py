"""The FP8 linear's kernels per Llama-3.1-8B linear and row count (issue 29): what the FP8 method runs against the
alternatives, on one H200, one process, no engine.

    python3 examples/gpu/fp8_gemm_check.py --out $OUT/fp8_gemm.json                 # H200, ~40 s of GPU
    python examples/gpu/fp8_gemm_check.py --dry-run --out /tmp/fp8_gemm.json        # CPU, Triton interpreter

Per (linear, M), mean us of one call (w4_gemv_sweep's Timer: a CUDA graph of ~100 calls, weights rotated past
256 MB so every call reads HBM) and each variant's error against a float32 product of the same e4m3 weights:
    bf16        F.linear on the bf16 weight (cuBLAS): the dense model's product
    rowwise     what the FP8 method runs above 4 rows: the one-pass per-token e4m3 quantization of x
                (fp8/kernel.py), then torch._scaled_mm with a per-token scale_a and a per-row scale_b
    tensorwise  one scale for x (its max over the whole tensor, so a reduction before the quantization) and one
                for W: torch._scaled_mm with two scalars, the scheme vLLM's on-the-fly FP8 runs through CUTLASS
    gemv        M <= 4: the dense decode GEMV on e4m3 weights with row scales (core/layers/dense_gemv_kernel.py
                NOTE 7; W8A16, x not quantized): what the FP8 method runs at decode sizes
The verdict per M: which variant is fastest, and the GEMV's time against rowwise's (the route it replaced).
--explore: per linear at M = 1, the GEMV over a grid of (BLOCK_N, BLOCK_K, warps, split), the rule's blocks
first; the fastest point per linear is printed beside the rule's.
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

sys.path.insert(0, os.path.dirname(__file__))
from gemv_sweep import err_of  # noqa: E402
from w4_gemv_sweep import Timer  # noqa: E402

FP8 = torch.float8_e4m3fn
LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 4, 8, 64, 256, 2048, 16384)
ROTATE_BYTES = 256 << 20


def quantized(n: int, k: int, device: str, copies: int) -> list[dict[str, torch.Tensor]]:
    """`copies` of one random weight: bf16, e4m3 with row scales (the method's quantize_rows) and e4m3 with one
    tensor scale."""
    from pagedllm.plugins.quantization.fp8.method import quantize_rows

    w = torch.randn(n, k, device=device) * 0.02
    q_row, s_row = quantize_rows(w)
    s_t = (w.abs().max() / 448.0).reshape(())
    q_t = (w / s_t).clamp(-448, 448).to(FP8)
    one = {"bf16": w.to(torch.bfloat16), "q_row": q_row, "s_row": s_row.float(), "q_t": q_t, "s_t": s_t.float()}
    return [one] + [{key: v.clone() for key, v in one.items()} for _ in range(copies - 1)]


def variants(ws: list[dict[str, torch.Tensor]], x: torch.Tensor, m: int, dry: bool) -> dict[str, list[Callable[[], torch.Tensor]]]:
    from pagedllm.api.kernels import dense_gemv, gemv_blocks
    from pagedllm.plugins.quantization.fp8.method import quantize_activations

    out: dict[str, list[Callable[[], torch.Tensor]]] = {"bf16": [lambda w=w: F.linear(x, w["bf16"]) for w in ws]}
    if not dry:  # torch._scaled_mm needs the GPU
        def rowwise(w: dict[str, torch.Tensor]) -> torch.Tensor:
            x_q, a = quantize_activations(x, None)
            return torch._scaled_mm(x_q, w["q_row"].t(), scale_a=a, scale_b=w["s_row"].unsqueeze(0),
                                    out_dtype=torch.bfloat16)

        def tensorwise(w: dict[str, torch.Tensor]) -> torch.Tensor:
            a = (x.abs().max().float() / 448.0).clamp(min=1e-12)
            x_q = (x.float() / a).clamp(-448, 448).to(FP8)
            return torch._scaled_mm(x_q, w["q_t"].t(), scale_a=a, scale_b=w["s_t"], out_dtype=torch.bfloat16)

        out["rowwise"] = [lambda w=w: rowwise(w) for w in ws]
        out["tensorwise"] = [lambda w=w: tensorwise(w) for w in ws]
    blocks = gemv_blocks(x, ws[0]["q_row"], None) if not dry else None
    if m <= 4 and (blocks is not None or dry):
        from pagedllm.layers.dense_gemv import DenseGemvBlocks, default_blocks

        b: DenseGemvBlocks = blocks or default_blocks(m, *ws[0]["q_row"].shape, 132, element_bytes=1)
        out["gemv"] = [lambda w=w: dense_gemv(x, w["q_row"], None, b, row_scale=w["s_row"]) for w in ws]
    return out


EXPLORE_TILES = [(bn, bk, w) for bn in (4, 8, 16) for bk, w in ((1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))]


def explore(timer: Timer, linears: dict[str, tuple[int, int]], device: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    """The one-row FP8 GEMV over EXPLORE_TILES x splits 1, 2 per linear (the rule's blocks first)."""
    from pagedllm.api.kernels import dense_gemv
    from pagedllm.layers.dense_gemv import DenseGemvBlocks, default_blocks

    rows = []
    for name, (n, k) in linears.items():
        ws = quantized(n, k, device, max(1, min(8, ROTATE_BYTES // (n * k))))
        x = (torch.randn(1, k, device=device) * 0.5).to(dtype)
        rule = default_blocks(1, n, k, 132 if device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count,
                              element_bytes=1)
        grid = [rule] + [DenseGemvBlocks(bn, bk, w, sp) for bn, bk, w in EXPLORE_TILES for sp in (1, 2)
                         if bk <= k and DenseGemvBlocks(bn, bk, w, sp) != rule]
        times = {}
        for b in grid[: 2 if device == "cpu" else None]:
            times[tuple(b)] = round(timer.us_per_call([lambda w=w, b=b: dense_gemv(x, w["q_row"], None, b, row_scale=w["s_row"])
                                                       for w in ws]), 2)
        best = min(times, key=times.__getitem__)
        row = {"linear": name, "n": n, "k": k, "rule": list(rule), "rule_us": times[tuple(rule)],
               "best": list(best), "best_us": times[best], "tb_per_s_best": round(n * k / times[best] / 1e6, 2),
               "grid_us": {str(list(b)): t for b, t in times.items()}}
        print(json.dumps({key: v for key, v in row.items() if key != "grid_us"}), flush=True)
        rows.append(row)
        del ws
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: the paths run")
    ap.add_argument("--explore", action="store_true", help="also a grid of one-row GEMV blocks per linear")
    ap.add_argument("--only-explore", action="store_true", help="the grid alone (no variant table)")
    args = ap.parse_args()
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float16 if dry else torch.bfloat16  # the interpreter's bf16 math is wrong
    timer = Timer(dry)
    linears = {"tiny": (64, 256)} if dry else LINEARS
    rows = (1, 4) if dry else ROWS
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if not dry else "cpu (interpreter)",
                              "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "points": []}
    if args.explore or args.only_explore:
        report["explore"] = explore(timer, {"tiny": (64, 4096)} if dry else LINEARS, device, dtype)
    for name, (n, k) in ({} if args.only_explore else linears).items():
        copies = max(1, min(8, ROTATE_BYTES // (n * k)))
        ws = quantized(n, k, device, copies)
        if dry:
            for w in ws:
                w["bf16"] = w["bf16"].to(dtype)
        for m in rows:
            x = (torch.randn(m, k, device=device) * 0.5).to(dtype)
            ref = x.float() @ (ws[0]["q_row"].float() * ws[0]["s_row"][:, None]).T
            point: dict[str, Any] = {"linear": name, "n": n, "k": k, "m": m}
            for variant, fns in variants(ws, x, m, dry).items():
                point[variant] = {"us": round(timer.us_per_call(fns), 2), "err": err_of(fns[0](), ref)}
            timed = {v: point[v]["us"] for v in ("bf16", "rowwise", "tensorwise", "gemv") if v in point}
            point["fastest"] = min(timed, key=timed.__getitem__)
            if "gemv" in point and "rowwise" in point:
                point["gemv_vs_rowwise"] = round(point["rowwise"]["us"] / point["gemv"]["us"], 3)
            report["points"].append(point)
            print(json.dumps(point), flush=True)
        del ws
        if not dry:
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
