"""How fast are a W1 prompt wave's GEMMs, and does any cuBLAS choice beat the default? (issue 5, perf-notes §17)

    python examples/gpu/gemm_probe.py --out $OUT/gemm.json      # H200, ~1-2 minutes

W1's mixed steps (16,216 tokens on average, 65 of them, 395 ms of GPU each) are ~81 % cuBLAS GEMMs at
~720 TFLOP/s. This times the four projections of a Llama-3.1-8B layer (qkv 4096->6144, o 4096->4096,
gate_up 4096->28672, down 14336->4096, bf16, weights [out, in] as nn.Linear keeps them) at the step sizes
W1 runs, as CUDA-graph replays of one call, three ways: torch's default cuBLAS call, with cuBLASLt
preferred, and through TunableOp (every cuBLAS/cuBLASLt candidate timed for the exact shape, the fastest
kept). It also times M rounded up to a multiple of 256 (tile quantization: is a ragged M slower per row?).
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


def sweep(ms: list[int], weights: dict[str, torch.Tensor], label: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        row: dict[str, float] = {}
        total_us, total_flop = 0.0, 0.0
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
            F.linear(x, w)  # TunableOp tunes on the first eager call (not inside a capture)
            torch.cuda.synchronize()
            us = graph_us(lambda x=x, w=w: F.linear(x, w), calls=4, iters=10)
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
    ap.add_argument("--out", default="gemm_probe.json")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    torch.manual_seed(0)
    weights = {k: torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02 for k, (kk, n) in SHAPES.items()}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["default"] = sweep(ms, weights, "default")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    result["cublaslt"] = sweep(ms, weights, "cublaslt")
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_max_tuning_duration(200)
    torch.cuda.tunable.set_filename(os.path.join(os.path.dirname(os.path.abspath(args.out)), "tunableop%d.csv"))
    result["tunableop"] = sweep(ms, weights, "tunableop")
    result["tunableop_choices"] = [str(r) for r in torch.cuda.tunable.get_results()]
    torch.cuda.tunable.tuning_enable(False)
    torch.cuda.tunable.enable(False)
    result["default_again"] = sweep(ms[:1], weights, "default")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
