"""W4A16 (AWQ / GPTQ layouts) and FP8 linear layers on the GPU: agreement, block tuning, speed vs bf16.

    python examples/gpu/quant_bench.py --out $OUT/quant.json [--quick]

Llama-3.1-8B linear shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336), random codes:
  1. agreement: the Triton W4A16 GEMM and the FP8 method vs dequantize-then-matmul in float32
  2. tuning at M = 1: every (BLOCK_N, BLOCK_K, warps) of a small grid, per shape; the best is reported
  3. time per decoder layer's four linears (CUDA-graph replay, triton.testing.do_bench_cudagraph), bf16
     F.linear vs W4 AWQ / W4 GPTQ (+ act-order) / W8 / W2 at M = 1, 16 (decode) and 2048 (prefill);
     FP8 W8A8 (torch._scaled_mm, dynamic per-token activations, quantization included) vs bf16 at
     M = 2048, 8192 (prefill-heavy)
Only pagedllm's quantization modules are imported (torch + triton; no engine, no pydantic).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(v: torch.Tensor) -> torch.Tensor:
    v = v & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit codes -> [R, C/8] AWQ words (output 8c + AWQ_ORDER[i] in nibble i)."""
    v = codes.long().view(codes.shape[0], -1, 8)[:, :, AWQ_ORDER]
    shifts = torch.arange(8, device=codes.device) * 4
    return to_int32((v << shifts).sum(-1))


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    pf = 32 // bits
    v = codes.long().view(codes.shape[0], -1, pf)
    return to_int32((v << (torch.arange(pf, device=codes.device) * bits)).sum(-1))


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    pf = 32 // bits
    v = codes.long().view(-1, pf, codes.shape[1])
    return to_int32((v << (torch.arange(pf, device=codes.device) * bits).view(1, pf, 1)).sum(1))


def make_packed(kind: str, bits: int, n: int, k: int, group: int, act_order: bool) -> dict[str, Any]:
    from pagedllm.plugins.quantization.w4a16_layout import PackedLayout

    maxq = (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (k, n), device="cuda", dtype=torch.int32)
    z = torch.randint(1, maxq + 1, (k // group, n), device="cuda", dtype=torch.int32)
    s = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
    g_idx = None
    if kind == "awq":
        layout = PackedLayout("awq", 4, group)
        qweight, qzeros = pack_awq(q), pack_awq(z)
    else:
        layout = PackedLayout("gptq", bits, group, zero_offset=1)
        qweight, qzeros = pack_rows(q, bits), pack_cols(z - 1, bits)
        if act_order:
            g_idx = (torch.randperm(k, device="cuda") // group).to(torch.int32)
    return dict(layout=layout, qweight=qweight, qzeros=qzeros, scales=s, g_idx=g_idx, n=n)


def bench(fn: Any) -> float:
    """Median microseconds of one call, replayed in a CUDA graph (launch overhead out, as in decode)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=40)) * 1000


def agreement(results: dict[str, Any]) -> None:
    from pagedllm.plugins.quantization.w4a16_kernel import w4a16_gemm
    from pagedllm.plugins.quantization.w4a16_layout import dequantize

    out = results.setdefault("agreement", {})
    n, k = SHAPES["o"]
    for name, kind, bits, act in [("awq4", "awq", 4, False), ("gptq4_actorder", "gptq", 4, True),
                                  ("gptq8", "gptq", 8, False), ("gptq2", "gptq", 2, False)]:
        p = make_packed(kind, bits, n, k, 128, act)
        w_t = dequantize(p["layout"], p["qweight"], p["qzeros"], p["scales"], p["g_idx"], dtype=torch.float32)
        for m in (1, 16, 300):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, k, device="cuda").to(dtype)
                y = w4a16_gemm(x, p["layout"], p["qweight"], p["qzeros"], p["scales"].to(dtype), p["g_idx"], n)
                ref = x.float() @ w_t
                out[f"{name}_m{m}_{str(dtype)[6:]}"] = float((y.float() - ref).norm() / ref.norm())
    for m in (1, 300):
        layer, w = fp8_layer(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ (layer.weight.float() * layer.fp8_row_scale.unsqueeze(1)).t()
        y = layer.quant_method.apply(layer, x, None)
        out[f"fp8_scaled_mm_m{m}"] = float((y.float() - ref).norm() / ref.norm())
        out[f"fp8_vs_bf16_weights_m{m}"] = float((y.float() - x.float() @ w.float().t()).norm() / ref.norm())
        out["fp8_uses_scaled_mm"] = bool(layer.__dict__["fp8_scaled_mm"])


def fp8_layer(n: int, k: int) -> tuple[nn.Module, torch.Tensor]:
    """An on-the-fly FP8 layer (bf16 weights quantized per row) on the GPU, and its bf16 weight."""
    from pagedllm.plugins.quantization.fp8_method import Fp8LinearMethod, Fp8Scheme

    layer = nn.Module()
    layer.output_partition_sizes = [n]  # type: ignore[assignment]
    method = Fp8LinearMethod(Fp8Scheme(checkpoint_fp8=False, weight_strategy="channel", activations="dynamic"))
    with torch.device("cuda"):
        method.create_weights(layer, k, [n], torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    layer.quant_method = method  # type: ignore[assignment]
    return layer, w


def tuning(results: dict[str, Any], quick: bool) -> None:
    from pagedllm.plugins.quantization.w4a16_kernel import w4a16_gemm

    grids = {
        1: [(16, bn, bk, 4, sk) for bn in (32, 64, 128) for bk in (64, 128, 256) for sk in (1, 2, 4, 8)],
        2048: [(64, 64, 64, 4, 1), (128, 64, 64, 4, 1), (64, 128, 64, 4, 1), (128, 128, 64, 8, 1),
               (128, 128, 32, 4, 1), (128, 256, 64, 8, 1)],
    }
    if quick:  # one K step, the splits and tile widths that matter most; no prefill sweep
        grids = {1: [(16, bn, 128, 4, sk) for bn in (32, 64, 128) for sk in (1, 2, 4, 8)]}
    for m, grid in grids.items():
        out = results.setdefault(f"tuning_m{m}", {})
        for shape, (n, k) in SHAPES.items():
            p = make_packed("gptq", 4, n, k, 128, False)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            call = functools.partial(w4a16_gemm, x, p["layout"], p["qweight"], p["qzeros"], p["scales"], None, n)
            times = {}
            for cfg in grid:
                try:
                    call(blocks=cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # e.g. too much shared memory: that config is out
                    times[str(cfg)] = f"{type(exc).__name__}"
                    continue
                times[str(cfg)] = bench(functools.partial(call, blocks=cfg))
            ok = {c: t for c, t in times.items() if isinstance(t, float)}
            best = min(ok, key=ok.__getitem__)
            out[shape] = {"best": best, "best_us": ok[best], "default_us": bench(call), "all": times}


def speed(results: dict[str, Any], quick: bool) -> None:
    from pagedllm.plugins.quantization.w4a16_kernel import w4a16_gemm

    out = results.setdefault("layer_us", {})
    variants = [("awq4", "awq", 4, False), ("gptq4", "gptq", 4, False), ("gptq4_actorder", "gptq", 4, True),
                ("gptq8", "gptq", 8, False), ("gptq2", "gptq", 2, False)]
    ms = (1, 16, 2048)
    for m in ms:
        row: dict[str, float] = {}
        for n, k in SHAPES.values():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            row["bf16"] = row.get("bf16", 0.0) + bench(lambda x=x, w=w: F.linear(x, w))
            for name, kind, bits, act in variants:
                p = make_packed(kind, bits, n, k, 128, act)
                row[name] = row.get(name, 0.0) + bench(
                    lambda x=x, p=p: w4a16_gemm(x, p["layout"], p["qweight"], p["qzeros"], p["scales"], p["g_idx"], p["n"]))
                torch.cuda.synchronize()
            del w
        row.update({f"speedup_{k}": row["bf16"] / v for k, v in list(row.items()) if k != "bf16"})
        out[f"m{m}"] = row
    for m in (2048, 8192):
        row = {"bf16": 0.0, "fp8": 0.0}
        for n, k in SHAPES.values():
            layer, w = fp8_layer(n, k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row["bf16"] += bench(lambda x=x, w=w: F.linear(x, w))
            row["fp8"] += bench(lambda x=x, layer=layer: layer.quant_method.apply(layer, x, None))
        row["speedup_fp8"] = row["bf16"] / row["fp8"]
        out[f"fp8_m{m}"] = row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    for stage in (agreement, tuning, speed):
        t0 = time.time()
        try:
            stage(results) if stage is agreement else stage(results, args.quick)  # type: ignore[call-arg]
        except Exception as exc:  # keep the other stages' numbers
            import traceback

            results[f"{stage.__name__}_error"] = traceback.format_exc()[-3000:]
            print(f"{stage.__name__} failed: {exc}", file=sys.stderr)
        results[f"{stage.__name__}_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if not k.startswith("tuning_m")}, indent=1))
    for key in ("tuning_m1", "tuning_m2048"):
        for shape, t in results.get(key, {}).items():
            print(key, shape, t["best"], f"{t['best_us']:.1f}us", f"default {t['default_us']:.1f}us")


if __name__ == "__main__":
    main()
