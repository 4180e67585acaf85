"""Can a Triton GEMM beat cuBLAS on a decode step's wave-quantized projections? (issue 5, perf-notes §18c)

    python examples/gpu/decode_gemm_probe.py --out $OUT/decode_gemm.json      # H200, ~1-2 minutes

W2's decode steps (500 requests, graphs padded to 512 rows) spend ~10 ms of ~23 in cuBLAS. The eager profile
(§18c) and gemm_probe.py at 512 rows put the qkv (4096 -> 6144) and o (4096 -> 4096) products at 555-570 TFLOP/s
against ~700-750 for gate_up and down: cuBLAS picks 192 x 128 / 128 x 128 tiles, 96-192 of them for 132 SMs, so
the last wave runs part-empty. This times a plain Triton TMA GEMM (one [BM, BN] tile per program, grouped
order) over several tile shapes against F.linear, both as CUDA-graph replays that cycle through 4 copies of
the weight (an engine step reads each layer's weight from HBM; one copy would sit in the 50 MB L2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from fused_ops_bench import graph_us  # noqa: E402

from pagedllm.plugins.quantization.unquantized.gated_gemm_kernel import _tile_of  # noqa: E402  (the grouped tile order)

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONFIGS = [  # (BM, BN, BK, warps, stages)
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 64, 4, 5), (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 6), (128, 256, 64, 8, 3), (64, 256, 64, 4, 4), (128, 128, 128, 8, 3),
]
COPIES = 4


@triton.jit
def _gemm_kernel(a_desc, w_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(tl.cdiv(K, BK)):
        acc = tl.dot(a_desc.load([pid_m * BM, k * BK]), w_desc.load([pid_n * BN, k * BK]).T, acc)
    c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_desc.dtype))


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, ...]) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    a = TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk])
    b = TensorDescriptor(w, [n, k], [w.stride(0), 1], [bn, bk])
    c = TensorDescriptor(out, [m, n], [out.stride(0), 1], [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](a, b, c, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def cycled_us(op: Any, ws: list[torch.Tensor]) -> float:
    """Device microseconds per call of op(w), the calls cycling through the weight copies ws."""

    def run() -> None:
        for w in ws:
            op(w)

    return graph_us(run, calls=2, iters=10) / len(ws)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="512,500,288,768,256")
    ap.add_argument("--out", default="decode_gemm.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    weights = {name: [torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-1e-3, 1e-3)
                      for _ in range(COPIES)] for name, (k, n) in SHAPES.items()}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": {}}
    for m in (int(v) for v in args.ms.split(",")):
        for name, ws in weights.items():
            x = torch.randn(m, ws[0].shape[1], device="cuda", dtype=torch.bfloat16)
            flop = 2.0 * m * ws[0].shape[0] * ws[0].shape[1]
            ref = F.linear(x, ws[0])

            base = cycled_us(lambda w, x=x: F.linear(x, w), ws)
            row: dict[str, Any] = {"cublas_us": round(base, 2), "cublas_tflops": round(flop / base / 1e6, 1)}
            best = None
            for cfg in CONFIGS:
                try:
                    err = float((triton_linear(x, ws[0], cfg).float() - ref.float()).norm() / ref.float().norm())
                    us = cycled_us(lambda w, x=x, cfg=cfg: triton_linear(x, w, cfg), ws)
                except Exception as exc:  # noqa: BLE001 - a config that does not fit is a data point
                    row[str(cfg)] = f"{type(exc).__name__}"[:60]
                    continue
                row[str(cfg)] = {"us": round(us, 2), "tflops": round(flop / us / 1e6, 1), "rel": round(err, 5)}
                if best is None or us < best[1]:
                    best = (cfg, us)
            if best is not None:
                row["best"] = str(best[0])
                row["best_vs_cublas"] = round(base / best[1], 3)
            result["rows"][f"{m}:{name}"] = row
            print(f"M={m:5d} {name:8s} cuBLAS {row['cublas_tflops']:6.1f} TFLOP/s ({base:7.2f} us)  best triton "
                  f"{row.get('best')} x{row.get('best_vs_cublas')}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
