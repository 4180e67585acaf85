"""Probe (issue 29): an FP8-weight GEMM for 4-256 activation rows with split-K, against what the FP8 method runs.

    python3 examples/gpu/fp8_splitk_probe.py --out $OUT/fp8_splitk.json            # H200, ~1-2 min of GPU
    python examples/gpu/fp8_splitk_probe.py --dry-run --out /tmp/fp8_splitk.json   # CPU, Triton interpreter

Why: fp8_gemm_check.py (2026-12-03) found the method's route above 2 rows -- the per-token e4m3 quantization of
x, then torch._scaled_mm with row scales (cuBLASLt) -- slower than bf16 cuBLAS on o and down at 4-256 rows and
on qkv up to 64 (down at 8 rows: 46.8 us where 59 MB of e4m3 weights stream in ~14 us). cuBLASLt picks one
128 x 128 tile without split-K there, so a 4096-column output has 32 blocks for 132 SMs.

The probe's kernel reads the e4m3 weight tile, widens it to the activations' dtype in registers and multiplies the bf16
activations with tl.dot (W8A16: no activation quantization, no extra launch), over a grid of (BLOCK_M,
BLOCK_N, BLOCK_K, SPLIT_K, warps, stages); SPLIT_K > 1 adds float32 partials with atomics into a zeroed buffer
(the zeroing and the final bf16 cast are timed with it). Per (linear, M): rowwise's time, bf16 cuBLAS's (what
a bf16 model pays; an FP8 model has no bf16 weights), the probe's best point and its error against a float32
product of the same e4m3 weights. A measurement script, not an engine path: the method is unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from fp8_gemm_check import LINEARS, ROTATE_BYTES, quantized  # noqa: E402
from gemv_sweep import err_of  # noqa: E402
from w4_gemv_sweep import Timer  # noqa: E402

ROWS = (4, 8, 16, 32, 64, 128, 256)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_span = K // SPLIT_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * k_span, (pid_k + 1) * k_span, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None])  # [BLOCK_K, BLOCK_N] e4m3
        acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    acc = acc * tl.load(s_ptr + offs_n)[None, :]
    out = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=offs_m[:, None] < M)
    else:
        tl.atomic_add(out, acc, mask=offs_m[:, None] < M)


def w8a16(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, cfg: tuple[int, ...]) -> torch.Tensor:
    bm, bn, bk, split, warps, stages = cfg
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype) if split == 1 else torch.zeros(m, n, device=x.device)
    grid = (n // bn, split, triton.cdiv(m, bm))
    _w8a16_kernel[grid](x, q, s, y, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                        num_warps=warps, num_stages=stages)
    return y if split == 1 else y.to(x.dtype)


def configs(m: int, n: int, k: int, dry: bool) -> list[tuple[int, ...]]:
    bms = [bm for bm in (16, 32, 64, 128) if bm >= min(m, 64) // 2 and bm <= max(16, m)] or [16]
    out = [(bm, bn, bk, sp, w, st) for bm in bms for bn in (64, 128) for bk in (128, 256)
           for sp in (1, 2, 4, 8) for w in (4,) for st in (4,)
           if k % (bk * sp) == 0 and n % bn == 0 and (n // bn) * sp * -(-m // bm) <= 8 * 132]
    return out[:2] if dry else out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: the paths run")
    args = ap.parse_args()
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    timer = Timer(dry)
    linears = {"tiny": (128, 256)} if dry else LINEARS
    rows_out: list[dict[str, Any]] = []
    for name, (n, k) in linears.items():
        ws = quantized(n, k, device, 1 if dry else max(1, min(8, ROTATE_BYTES // (n * k))))
        for m in ((4, 20) if dry else ROWS):
            x = (torch.randn(m, k, device=device) * 0.5).to(torch.float16 if dry else torch.bfloat16)
            ref = x.float() @ (ws[0]["q_row"].float() * ws[0]["s_row"].float()[:, None]).t()
            row: dict[str, Any] = {"linear": name, "n": n, "k": k, "m": m}
            if not dry:
                from pagedllm.plugins.quantization.fp8.method import quantize_activations

                def rowwise(w: dict[str, torch.Tensor], x: torch.Tensor = x) -> torch.Tensor:
                    x_q, a = quantize_activations(x, None)
                    return torch._scaled_mm(x_q, w["q_row"].t(), scale_a=a, scale_b=w["s_row"].unsqueeze(0),
                                            out_dtype=torch.bfloat16)

                row["rowwise_us"] = round(timer.us_per_call([lambda w=w: rowwise(w) for w in ws]), 2)
                row["bf16_us"] = round(timer.us_per_call([lambda w=w, x=x: F.linear(x, w["bf16"]) for w in ws]), 2)
            best: tuple[float, tuple[int, ...]] | None = None
            for cfg in configs(m, n, k, dry):
                fns: list[Callable[[], torch.Tensor]] = [lambda w=w, c=cfg, x=x: w8a16(x, w["q_row"], w["s_row"], c)
                                                         for w in ws]
                try:
                    us = timer.us_per_call(fns)
                except Exception as exc:  # a point that does not compile (shared memory): skipped, said
                    print(f"# {name} m={m} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            assert best is not None
            row["probe_us"], row["probe_cfg"] = round(best[0], 2), list(best[1])
            row["probe_err"] = err_of(w8a16(x, ws[0]["q_row"], ws[0]["s_row"], best[1]), ref)
            row["probe_tb_per_s"] = round(n * k / best[0] / 1e6, 2)
            if "rowwise_us" in row:
                row["rowwise_over_probe"] = round(row["rowwise_us"] / best[0], 3)
            print(json.dumps(row), flush=True)
            rows_out.append(row)
        del ws
    with open(args.out, "w") as f:
        json.dump({"rows": rows_out, "device": "cpu" if dry else torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
