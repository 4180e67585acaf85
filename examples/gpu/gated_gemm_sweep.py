"""The gated GEMM (plugins/quantization/unquantized/gated_gemm_kernel.py) against what the engine runs now at prompt sizes: cuBLAS's
[gate | up] GEMM, then act_and_mul (issue 5, perf-notes §17e item 3).

    python examples/gpu/gated_gemm_sweep.py --out $OUT/gated.json      # H200, ~1 minute

Llama-3.1-8B's MLP (K = 4096, I = 14,336), bf16, M in --ms. Both paths as CUDA-graph replays of one call
(fused_ops_bench.graph_us); each config checked against the unfused output first (relative L2; they differ
only in the GEMM's summation order, gated_gemm_kernel NOTE 1). TFLOP/s count the GEMM's 2 M K 2I. The
engine switch is the config key `gated_gemm` (env PAGEDLLM_GATED_GEMM=true; gated_gemm.py); a config that wins here becomes DEFAULT_CONFIG.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from fused_ops_bench import graph_us  # noqa: E402

CONFIGS = [  # (bm, bn, bk, warps, stages, group_m, persistent[, warp_specialize]); DEFAULT_CONFIG is the 6th
    (128, 128, 64, 8, 3, 8, False), (128, 128, 64, 8, 4, 8, False), (128, 128, 64, 8, 3, 16, False),
    (128, 128, 64, 8, 3, 4, False), (128, 128, 32, 8, 4, 8, False), (128, 64, 64, 4, 4, 8, False),
    (128, 64, 64, 8, 4, 8, False), (256, 64, 64, 8, 3, 8, False), (64, 128, 64, 4, 4, 8, False),
    (128, 128, 64, 8, 3, 8, True), (128, 128, 64, 8, 4, 8, True), (128, 64, 64, 4, 4, 8, True),
    (256, 64, 64, 8, 3, 8, True),
    # warp-specialized K loop (gated_gemm_kernel NOTE 4): a producer warp for the TMA loads
    (128, 128, 64, 8, 3, 8, False, True), (128, 128, 64, 8, 4, 8, False, True), (128, 256, 64, 8, 3, 8, False, True),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16384,8192,4096,2048")
    ap.add_argument("--out", default="gated_gemm_sweep.json")
    args = ap.parse_args()
    from pagedllm.layers.triton_ops import act_and_mul
    from pagedllm.plugins.quantization.unquantized.gated_gemm import GatedGemmConfig
    from pagedllm.plugins.quantization.unquantized.gated_gemm_kernel import gated_gemm

    def unfused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return act_and_mul(F.linear(x, w))

    torch.manual_seed(0)
    k, half = 4096, 14336
    w = torch.randn(2 * half, k, device="cuda", dtype=torch.bfloat16) * 0.02
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    import triton

    result["triton"] = triton.__version__
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        flop = 2.0 * m * k * 2 * half
        ref = act_and_mul(F.linear(x, w))
        base_us = graph_us(functools.partial(unfused, x, w), calls=4, iters=10)
        gemm_us = graph_us(functools.partial(F.linear, x, w), calls=4, iters=10)
        rows: list[dict[str, Any]] = [{"what": "cuBLAS + act_and_mul", "us": round(base_us, 1),
                                       "TFLOPs": round(flop / base_us / 1e6, 1)},
                                      {"what": "cuBLAS GEMM alone", "us": round(gemm_us, 1),
                                       "TFLOPs": round(flop / gemm_us / 1e6, 1)}]
        for fields in CONFIGS:
            cfg = GatedGemmConfig(*fields)
            row: dict[str, Any] = {"what": f"gated {cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.num_warps} s{cfg.num_stages} "
                                           f"g{cfg.group_m}" + (" persistent" if cfg.persistent else "")
                                           + (" ws" if cfg.warp_specialize else "")}
            try:
                got = gated_gemm(x, w, "silu", cfg)
                row["rel"] = float((got.float() - ref.float()).norm() / ref.float().norm())
                us = graph_us(functools.partial(gated_gemm, x, w, "silu", cfg), calls=4, iters=10)
                row.update(us=round(us, 1), TFLOPs=round(flop / us / 1e6, 1), vs_base=round(base_us / us, 3))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a data point
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
        result["rows"][str(m)] = rows
        print(f"== M = {m}")
        for r in rows:
            print("   " + "  ".join(f"{key}={val}" for key, val in r.items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
