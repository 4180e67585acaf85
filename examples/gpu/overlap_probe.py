"""Does memory-bound decode attention overlap with a compute-bound GEMM on one H200? (issue 5, perf-notes §14f)

    python examples/gpu/overlap_probe.py --out $OUT/overlap.json      # H200, < 1 minute

W2's and W5's decode steps are ~52 % attention (streaming K/V at ~4 TB/s) and ~42 % GEMMs (~750 TFLOP/s at
M ~ 500). Splitting a step's batch into two halves and running one half's attention beside the other half's
GEMM (NanoFlow's nano-batches) only pays if the two kernels actually share the GPU. This probe times, as
CUDA-graph replays: the triton decode attention of half of a W2 batch (250 requests x U[128, 1152] keys),
the gate_up GEMM of 250 rows (4096 -> 28672, bf16), both one after the other on one stream, and both on two
streams forked and joined inside the graph. overlap = (serial - concurrent) / min(attention, GEMM): 0 means
the second kernel waited for SMs, 1 means the shorter one was hidden entirely.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fused_ops_bench import graph_us  # noqa: E402
from h200_check import paged_batch  # noqa: E402


def two_streams(first: Callable[[], Any], second: Callable[[], Any]) -> Callable[[], None]:
    """Both calls, the second on a side stream forked from and joined to the current one (graph-capturable)."""
    side = torch.cuda.Stream()

    def run() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        first()
        with torch.cuda.stream(side):
            second()
        main.wait_stream(side)

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=250)
    args = ap.parse_args()

    from pagedllm.plugins.attention.triton.kernels import unified_attention

    gen = torch.Generator().manual_seed(0)
    n = args.requests
    ctx = torch.randint(128, 1153, (n,), generator=gen).tolist()
    b = paged_batch(ctx, [1] * n, 32, 8, 128, 16, torch.bfloat16, gen, spare=0)
    c = b["common"]
    out_t = torch.empty_like(b["q"])
    attn = functools.partial(unified_attention, b["q"], b["cache"], out_t, c.query_start_loc, c.seq_lens,
                             c.block_table, n, n, 128**-0.5)
    x = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    y = torch.empty(n, 28672, device="cuda", dtype=torch.bfloat16)

    def gemm() -> None:
        torch.mm(x, w.t(), out=y)

    def serial() -> None:
        attn()
        gemm()

    t_attn, t_gemm = graph_us(attn), graph_us(gemm)
    t_serial, t_conc = graph_us(serial), graph_us(two_streams(attn, gemm))
    hidden = (t_serial - t_conc) / min(t_attn, t_gemm)
    kv_bytes = sum(x + 1 for x in ctx) * 8 * 128 * 2 * 2
    res = {"requests": n, "attention_us": round(t_attn, 1), "attention_TBps": round(kv_bytes / t_attn / 1e6, 3),
           "gemm_us": round(t_gemm, 1), "gemm_TFLOPs": round(2 * n * 4096 * 28672 / t_gemm / 1e6, 1),
           "serial_us": round(t_serial, 1), "two_streams_us": round(t_conc, 1), "overlap": round(hidden, 3)}
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
