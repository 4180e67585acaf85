"""How fast are a W1 prompt wave's GEMMs, and does any cuBLAS choice beat the default? (issue 5, perf-notes §17)

    python examples/gpu/gemm_probe.py --out $OUT/gemm.json      # H200, ~1 minute
    python examples/gpu/gemm_probe.py --modes default --ms 16384,16256,... --best-budget 16000:16900

W1's mixed steps (16,216 tokens on average, 65 of them, 395 ms of GPU each) are ~81 % cuBLAS GEMMs at
~720 TFLOP/s. This times the four projections of a Llama-3.1-8B layer (qkv 4096->6144, o 4096->4096,
gate_up 4096->28672, down 14336->4096, bf16, weights [out, in] as nn.Linear keeps them) at the step sizes
W1 runs (and decode-step sizes), as CUDA-graph replays and as eager launches: torch's default cuBLAS call;
through cuBLASLt (`lt`); with TunableOp enabled but not tuning (its "Default" op: the same gemm_internal call); the default again
(drift); and TunableOp tuning (every candidate timed for the exact shape, the fastest kept). The first run
(P25) found TunableOp faster while it chose "Default" for every shape: this separates the path from the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from fused_ops_bench import graph_us  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def eager_us(fn: Any, calls: int = 10) -> float:
    """Device microseconds per call of fn launched eagerly (as the engine's mixed steps run), median of 5."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def bmm_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T as a batch of one (cuBLAS's strided-batched GEMM, not the mm path F.linear takes)."""
    return torch.bmm(x.unsqueeze(0), w.t().unsqueeze(0))[0]


def sweep(ms: list[int], weights: dict[str, torch.Tensor], label: str, eager: bool = False,
          bmm: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        row: dict[str, float] = {}
        total_us, total_flop = 0.0, 0.0
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            op = bmm_linear if bmm else F.linear
            op(x, w)  # TunableOp tunes on the first eager call (not inside a capture)
            torch.cuda.synchronize()
            fn = lambda x=x, w=w, op=op: op(x, w)  # noqa: E731
            us = eager_us(fn) if eager else graph_us(fn, calls=4, iters=10)
            flop = 2.0 * m * w.shape[0] * w.shape[1]
            row[name] = round(flop / us / 1e6, 1)
            total_us += us
            total_flop += flop
        row["layer_us"] = round(total_us, 1)
        row["layer_tflops"] = round(total_flop / total_us / 1e6, 1)
        out[str(m)] = row
        print(f"{label:9s} M={m:6d} " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16216,16384,16880,8192,768,512")
    ap.add_argument("--modes", default="default,eager,notune,tuned", help="comma list, run in this order")
    ap.add_argument("--best-budget", default="", help="write the fastest M of this range (lo:hi) to the file --best-out")
    ap.add_argument("--best-out", default="best_budget.txt")
    ap.add_argument("--out", default="gemm_probe.json")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    torch.manual_seed(0)
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (kk, n) in SHAPES.items()}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    preferred = torch.backends.cuda.preferred_blas_library()
    print("preferred blas:", preferred, flush=True)
    for mode in args.modes.split(","):
        # lt: torch's mm through cuBLASLt (torch.backends.cuda.preferred_blas_library) -- TunableOp's
        # candidates include cuBLASLt algorithms, so this asks whether the Lt path itself is the faster one.
        torch.backends.cuda.preferred_blas_library("cublaslt" if mode == "lt" else preferred)
        # notune: TunableOp on, tuning off -- unseen shapes take its "Default" op (the same cuBLAS call)
        # through its path; tuned: every candidate timed for the exact shape, the fastest kept; bmm: the same
        # product as a strided-batched GEMM of one (another cuBLAS entry point and heuristic).
        torch.cuda.tunable.enable(mode in ("notune", "tuned"))
        torch.cuda.tunable.tuning_enable(mode == "tuned")
        if mode == "tuned":
            torch.cuda.tunable.set_max_tuning_duration(200)
        result[mode] = sweep(ms, weights, mode, eager=mode == "eager", bmm=mode == "bmm")
        if mode == "tuned":
            result["tuned_choices"] = [str(r) for r in torch.cuda.tunable.get_results()]
    torch.cuda.tunable.enable(False)
    if args.best_budget:
        lo, hi = (int(v) for v in args.best_budget.split(":"))
        rows = result["default"]
        best = max((m for m in ms if lo <= m <= hi), key=lambda m: rows[str(m)]["layer_tflops"])
        print(f"best budget in [{lo}, {hi}]: {best} ({rows[str(best)]['layer_tflops']} TFLOP/s per layer)")
        with open(args.best_out, "w") as f:
            f.write(str(best))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
