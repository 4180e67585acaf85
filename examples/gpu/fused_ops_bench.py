"""Fused Triton norm / rotary / SiLU-and-mul vs the torch path at Llama-3.1-8B sizes, on the GPU.

    python examples/gpu/fused_ops_bench.py [--rows 1,64,2048] [--dtype bfloat16]

Each op runs through its real layer (RMSNorm, RotaryEmbedding, SiluAndMul) twice: fused_mode "off" (the
torch ops) and "auto" (the Triton kernel). Reported per op and row count:
  check   max |fused - torch| and the share of elements that differ (bf16: the kernels round where the
          torch code rounds, so norm and SiLU should agree almost bit for bit; rotary rounds once in fp32)
  graph   device time per call: 50 calls captured in one CUDA graph, replayed, divided by 50 -- what a
          decode step inside a CUDA graph pays (no launch overhead)
  eager   one call between CUDA events, launch overhead included -- what an eager (prefill) step pays
  GB/s    bytes the op must move (each input read once, each output written once) / graph time
h200_check.py imports `stage_fused_ops` as its stage e.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

# Llama-3.1-8B: hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, rope theta 500000.
HIDDEN, HEADS, KV_HEADS, HEAD, INTER = 4096, 32, 8, 128, 14336
GRAPH_CALLS = 50


def graph_us(fn: Callable[[], Any], calls: int = GRAPH_CALLS, iters: int = 10) -> float:
    """Device microseconds per call of fn, from a CUDA graph of `calls` calls replayed `iters` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def eager_us(fn: Callable[[], Any], iters: int = 50) -> float:
    """Microseconds per call between CUDA events, launch overhead included (median)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (got.float() - ref.float()).abs()
    return {"max_abs": float(diff.max()), "rel_l2": float(diff.norm() / ref.float().norm().clamp_min(1e-12)),
            "frac_differ": float((diff > 0).float().mean())}


def _ops(rows: int, dtype: torch.dtype, dev: str) -> dict[str, tuple[Any, Callable[..., Any], int]]:
    """op name -> (layer, call(layer) returning the output(s), bytes moved per call)."""
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    size = torch.finfo(dtype).bits // 8
    g = torch.Generator(device=dev).manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device=dev, dtype=dtype, generator=g)
    res = torch.randn(rows, HIDDEN, device=dev, dtype=dtype, generator=g)
    norm = RMSNorm(HIDDEN, 1e-5, dtype).to(dev)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    q_size, kv_size = HEADS * HEAD, KV_HEADS * HEAD
    qkv = torch.randn(rows, q_size + 2 * kv_size, device=dev, dtype=dtype, generator=g)
    positions = torch.randint(0, 8192, (rows,), device=dev, generator=g)
    rope = RotaryEmbedding(HEAD, HEAD, 8192, 500000.0).to(dev)
    gate_up = torch.randn(rows, 2 * INTER, device=dev, dtype=dtype, generator=g)
    act = SiluAndMul()
    return {
        # read x, residual, weight; write normed and the new residual
        "add_rms_norm": (norm, lambda m: m(x, res), (4 * rows + 1) * HIDDEN * size),
        "rms_norm": (norm, lambda m: m(x), (2 * rows + 1) * HIDDEN * size),
        # read and write q and k (in place for the kernel), read a cos and a sin row per token
        "rotary_qk": (rope, lambda m: m(positions, qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]),
                      rows * (2 * (q_size + kv_size) * size + HEAD * 4)),
        # read gate and up, write the product
        "silu_and_mul": (act, lambda m: m(gate_up), rows * 3 * INTER * size),
    }


def bench_fused_ops(rows_list: list[int], dtype: torch.dtype) -> dict[str, Any]:
    from pagedllm.layers.fused_ops import set_fused_ops

    dev = "cuda"
    out: dict[str, Any] = {}
    for rows in rows_list:
        for name, (layer, call, nbytes) in _ops(rows, dtype, dev).items():
            row: dict[str, Any] = {"bytes": nbytes}
            # Correctness: each mode on fresh inputs (same seed): rotary rotates q and k in place.
            outputs = {}
            for mode in ("off", "auto"):
                fresh_layer, fresh_call, _ = _ops(rows, dtype, dev)[name]
                set_fused_ops(fresh_layer, mode)
                with torch.no_grad():
                    result = fresh_call(fresh_layer)
                outputs[mode] = [t.clone() for t in (result if isinstance(result, tuple) else (result,))]
            row["check"] = [_compare(a, b) for a, b in zip(outputs["auto"], outputs["off"], strict=True)]
            for mode, label in (("off", "torch"), ("auto", "fused")):
                set_fused_ops(layer, mode)
                run = functools.partial(call, layer)
                with torch.no_grad():
                    g_us, e_us = graph_us(run), eager_us(run)
                row[label] = {"graph_us": round(g_us, 2), "eager_us": round(e_us, 2),
                              "GBps": round(nbytes / (g_us * 1e-6) / 1e9, 1)}
            row["speedup_graph"] = round(row["torch"]["graph_us"] / row["fused"]["graph_us"], 2)
            out[f"{name}_rows{rows}"] = row
    return out


def stage_fused_ops(put: Callable[[str, Any], None], quick: bool = False) -> None:
    """h200_check stage e: the table above for rows 1, 64, 2048 (64 only with --quick), bf16."""
    rows = [64] if quick else [1, 64, 2048]
    put("e_fused_ops", bench_fused_ops(rows, torch.bfloat16))


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, 'torch -> fused us (speedup), GB/s') lines for h200_check's closing table."""
    lines = []
    for key, row in result.items():
        if isinstance(row, dict) and "fused" in row:
            speed = f"{row['torch']['graph_us']} -> {row['fused']['graph_us']} ({row['speedup_graph']}x)"
            lines.append((f"fused {key} graph us", f"{speed}, {row['fused']['GBps']} GB/s"))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64,2048")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    result = bench_fused_ops([int(r) for r in args.rows.split(",")], getattr(torch, args.dtype))
    print(json.dumps(result, indent=1))
    print("\n".join(f"{a:<40} {b}" for a, b in summary_rows(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
