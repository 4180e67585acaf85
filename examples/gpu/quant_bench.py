"""W4A16 (AWQ / GPTQ) and FP8 W8A8 linear layers vs bf16: agreement and speed, per decoder layer.

    python examples/gpu/quant_bench.py --out $OUT/quant.json [--quick]      # one H200, < 8 minutes
    python examples/gpu/quant_bench.py --dry-run --out /tmp/quant.json      # CPU, Triton interpreter, tiny shapes

Llama-3.1-8B linear shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336), random codes,
group 128; times are µs for one decoder layer's four linears (CUDA-graph replay, do_bench_cudagraph):
  1. agreement: W4 (the dispatcher: GEMV at M <= 8, GEMM below 128 rows, dequantize + cuBLAS from 128) vs
     dequantize-then-matmul in float32, AWQ
     (repacked at load as the method does) and GPTQ v1; FP8: the fused per-token quantization's bytes and
     scales vs the torch code, and the W8A8 output vs its dequantized weights
  2. tuning at M = 1: the GEMV's (BLOCK_N, BLOCK_K, warps, SPLIT_K) over a small grid, per shape
  3. speed, with each variant's relative error printed beside its time:
     bf16 F.linear | W4 dispatch | W4 GEMM alone (the old path at M <= 8 and M >= 128) at M = 1, 2, 4, 8, 16,
     128, 2048, 8192; and at M = 16, 128, 2048, 8192 'W4 dequant+cuBLAS' (w4_dequant_cublas, forced: the
     scratch W^T + torch.matmul), the dequantization kernel alone (w4_dequant_alone) and bf16 torch.mm on a
     [K, N] weight (bf16_kn: the "NN" cuBLAS layout the scratch gives, against F.linear's "TN")
     FP8 W8A8 (fused quantization) | FP8 with the torch quantization (the old path) at M = 1, 16, 2048, 8192
--dry-run runs every stage on the CPU under TRITON_INTERPRET=1 with tiny shapes and float16 (the interpreter's
bfloat16 math is wrong), FP8's _scaled_mm emulated in float32: it checks the script, not speed.
Only pagedllm's quantization modules are imported (torch + triton; no engine, no pydantic).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SHAPES_TINY = {"qkv": (192, 256), "o": (128, 256), "gate_up": (320, 256), "down": (128, 384)}
GROUP = 128
DEQUANT_MS = (16, 128, 130, 2048, 8192)  # rows at which the forced dequant+cuBLAS path is timed (130: dry run)


@dataclass
class Ctx:
    device: str
    dtype: torch.dtype
    shapes: dict[str, tuple[int, int]]
    w4_ms: tuple[int, ...]
    fp8_ms: tuple[int, ...]
    dry_run: bool
    quick: bool

    def time_us(self, fn: Callable[[], Any]) -> float:
        if self.dry_run:  # the interpreter: one call, to prove the path runs (not a speed)
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=40)) * 1000


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))


# ---- packed W4 weights -----------------------------------------------------------------------------------

def make_packed(ctx: Ctx, kind: str, n: int, k: int) -> dict[str, Any]:
    """Random 4-bit codes in the checkpoint's packing, then what the method keeps after loading."""
    from pagedllm.plugins.quantization.w4a16.layout import (
        AWQ_ORDER,
        PackedLayout,
        awq_to_gptq,
        pack_along_columns,
        pack_along_rows,
    )

    dev = ctx.device
    q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32)
    z = torch.randint(1, 16, (k // GROUP, n), device=dev, dtype=torch.int32)
    s = (torch.rand(k // GROUP, n, device=dev) * 0.02 + 0.001).to(ctx.dtype)
    if kind == "awq":  # AutoAWQ's packing (output 8c + AWQ_ORDER[i] in nibble i), repacked as the method does
        order = list(AWQ_ORDER)
        layout = PackedLayout("awq", 4, GROUP)
        qweight = pack_along_columns(q.view(k, -1, 8)[:, :, order].reshape(k, n), 4)
        qzeros = pack_along_columns(z.view(z.shape[0], -1, 8)[:, :, order].reshape(z.shape[0], n), 4)
        layout, qweight, qzeros = awq_to_gptq(layout, qweight, qzeros)
    else:  # GPTQ v1: zeros stored minus one
        layout = PackedLayout("gptq", 4, GROUP, zero_offset=1)
        qweight, qzeros = pack_along_rows(q, 4), pack_along_columns(z - 1, 4)
    w_t = ((q - z.repeat_interleave(GROUP, 0)).float() * s.float().repeat_interleave(GROUP, 0))  # [K, N]
    return dict(layout=layout, qweight=qweight, qzeros=qzeros, scales=s, n=n, w_t=w_t)


def w4_call(p: dict[str, Any], x: torch.Tensor, kernel: str = "dispatch", blocks: Any = None) -> torch.Tensor:
    from pagedllm.plugins.quantization.w4a16.dequant import w4a16_dequant_matmul, w4a16_dequantize
    from pagedllm.plugins.quantization.w4a16.gemv import w4a16_gemv
    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_gemm, w4a16_matmul

    args = (x, p["layout"], p["qweight"], p["qzeros"], p["scales"])
    if kernel == "gemm":
        return w4a16_gemm(*args, None, p["n"])
    if kernel == "dequant":
        return w4a16_dequant_matmul(*args, None, p["n"])
    if kernel == "dequant_alone":  # the scratch W^T [K, N] only
        return w4a16_dequantize(p["layout"], p["qweight"], p["qzeros"], p["scales"], None, p["n"], x.dtype)
    if kernel == "gemv":
        return w4a16_gemv(*args, p["n"], blocks=blocks)
    return w4a16_matmul(*args, None, p["n"])


# ---- FP8 W8A8 --------------------------------------------------------------------------------------------

def make_fp8(ctx: Ctx, n: int, k: int) -> dict[str, Any]:
    """bf16 weights quantized per output row (the on-the-fly method); float32 reference weights."""
    from pagedllm.plugins.quantization.fp8.method import quantize_rows

    w = (torch.randn(n, k, device=ctx.device) * 0.02).to(ctx.dtype)
    w_q, row_scale = quantize_rows(w)
    return dict(w=w, w_q=w_q, row_scale=row_scale, w_deq=w_q.float() * row_scale.unsqueeze(1))


def fp8_call(ctx: Ctx, p: dict[str, Any], x: torch.Tensor, quant: str = "fused") -> torch.Tensor:
    """fp8_method's W8A8 apply: quantize x per token, then _scaled_mm (emulated in float32 on a dry run)."""
    from pagedllm.plugins.quantization.fp8.kernel import quantize_per_token
    from pagedllm.plugins.quantization.fp8.method import quantize_activations_torch

    x_q, a = quantize_per_token(x) if quant == "fused" else quantize_activations_torch(x)
    if ctx.dry_run:
        return ((x_q.float() * a) @ p["w_deq"].t()).to(x.dtype)
    y = torch._scaled_mm(x_q, p["w_q"].t(), scale_a=a, scale_b=p["row_scale"].unsqueeze(0), out_dtype=torch.bfloat16)
    return y.to(x.dtype)


# ---- stages ----------------------------------------------------------------------------------------------

def agreement(ctx: Ctx, results: dict[str, Any]) -> None:
    from pagedllm.plugins.quantization.fp8.kernel import quantize_per_token
    from pagedllm.plugins.quantization.fp8.method import quantize_activations_torch
    from pagedllm.plugins.quantization.w4a16.dequant import DEQUANT_MIN_M
    from pagedllm.plugins.quantization.w4a16.gemv import gemv_reason
    from pagedllm.plugins.quantization.w4a16.layout import dequantize

    out = results.setdefault("agreement", {})
    n, k = ctx.shapes["o"]
    for kind in ("awq", "gptq"):
        p = make_packed(ctx, kind, n, k)
        for m in (*[m for m in ctx.w4_ms if m <= 16], 20, 300 if not ctx.dry_run else DEQUANT_MIN_M + 2):
            x = torch.randn(m, k, device=ctx.device).to(ctx.dtype)
            path = ("gemv" if gemv_reason(p["layout"], m, None) is None else
                    "dequant" if m >= DEQUANT_MIN_M else "gemm")
            out[f"w4_{kind}_m{m}_{path}"] = rel_err(w4_call(p, x), x.float() @ p["w_t"])
        x = torch.randn(16, k, device=ctx.device).to(ctx.dtype)  # the forced large-M path at a small M
        out[f"w4_{kind}_m16_dequant_forced"] = rel_err(w4_call(p, x, "dequant"), x.float() @ p["w_t"])
        w_t = w4_call(p, x, "dequant_alone")
        ref = dequantize(p["layout"], p["qweight"], p["qzeros"], p["scales"], None, dtype=ctx.dtype)
        out[f"w4_{kind}_dequant_kernel_bits_differ"] = int((w_t != ref).sum())
    p8 = make_fp8(ctx, n, k)
    for m in ctx.fp8_ms:
        x = torch.randn(m, k, device=ctx.device).to(ctx.dtype) * torch.rand(m, 1, device=ctx.device).to(ctx.dtype)
        q, a = quantize_per_token(x)
        q_ref, a_ref = quantize_activations_torch(x)
        out[f"fp8_quant_m{m}_bytes_differ"] = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
        out[f"fp8_quant_m{m}_scales_equal"] = bool(torch.equal(a, a_ref))
        y = fp8_call(ctx, p8, x)
        out[f"fp8_w8a8_m{m}_vs_its_weights"] = rel_err(y, x.float() @ p8["w_deq"].t())
        out[f"fp8_w8a8_m{m}_vs_bf16_weights"] = rel_err(y, x.float() @ p8["w"].float().t())


def tuning(ctx: Ctx, results: dict[str, Any]) -> None:
    """The GEMV at M = 1 over a small grid of (BLOCK_N, BLOCK_K, warps, SPLIT_K), per shape."""
    from pagedllm.plugins.quantization.w4a16.gemv import gemv_blocks

    out = results.setdefault("tuning_gemv_m1", {})
    tiles = [(128, 1), (256, 1), (256, 2), (512, 2), (512, 4)]
    block_ks = (64, 128, 256)
    if ctx.quick or ctx.dry_run:
        tiles, block_ks = [(256, 2)], (64, 128)
    for shape, (n, k) in ctx.shapes.items():
        p = make_packed(ctx, "gptq", n, k)
        x = torch.randn(1, k, device=ctx.device).to(ctx.dtype)
        default = gemv_blocks(p["layout"], 1, n, k)
        times: dict[str, Any] = {}
        for bn, warps in tiles:
            for bk in block_ks:
                for split in sorted({max(1, default.split_k // 2), default.split_k, default.split_k * 2}):
                    cfg = (bn, bk, warps, split)
                    call = functools.partial(w4_call, p, x, "gemv", cfg)
                    try:
                        call()
                    except Exception as exc:  # a config the kernel refuses: out
                        times[str(cfg)] = type(exc).__name__
                        continue
                    times[str(cfg)] = ctx.time_us(call)
        ok = {c: t for c, t in times.items() if isinstance(t, float)}
        best = min(ok, key=ok.__getitem__)
        out[shape] = {"default": str(tuple(default)), "default_us": ctx.time_us(functools.partial(w4_call, p, x)),
                      "best": best, "best_us": ok[best], "all": times}


def _add(row: dict[str, float], err: dict[str, float], name: str, us: float, e: float | None = None) -> None:
    """Sum a layer's time per variant; keep its worst relative error."""
    row[name] = row.get(name, 0.0) + us
    if e is not None:
        err[name] = max(err.get(name, 0.0), e)


def speed(ctx: Ctx, results: dict[str, Any]) -> None:
    out = results.setdefault("layer_us", {})
    for m in sorted(set(ctx.w4_ms) | set(ctx.fp8_ms)):
        row: dict[str, float] = {}
        err: dict[str, float] = {}
        add = functools.partial(_add, row, err)
        for n, k in ctx.shapes.values():
            x = torch.randn(m, k, device=ctx.device).to(ctx.dtype)
            w = (torch.randn(n, k, device=ctx.device) * 0.02).to(ctx.dtype)
            add("bf16", ctx.time_us(lambda x=x, w=w: F.linear(x, w)))
            if m in DEQUANT_MS:  # the layout the dequantized scratch hands cuBLAS: x [M, K] @ W^T [K, N]
                w_kn = w.t().contiguous()
                add("bf16_kn", ctx.time_us(lambda x=x, w_kn=w_kn: torch.mm(x, w_kn)))
                del w_kn
            del w
            if m in ctx.w4_ms:
                for kind in ("awq", "gptq"):
                    p = make_packed(ctx, kind, n, k)
                    ref = x.float() @ p["w_t"]
                    add(f"w4_{kind}", ctx.time_us(lambda x=x, p=p: w4_call(p, x)), rel_err(w4_call(p, x), ref))
                    if kind == "gptq" and (m <= 8 or m >= 128):  # the old path, for the comparison
                        add("w4_gemm_only", ctx.time_us(lambda x=x, p=p: w4_call(p, x, "gemm")),
                            rel_err(w4_call(p, x, "gemm"), ref))
                    if kind == "gptq" and m in DEQUANT_MS:  # perf-notes §5d: W4 dequant+cuBLAS
                        add("w4_dequant_cublas", ctx.time_us(lambda x=x, p=p: w4_call(p, x, "dequant")),
                            rel_err(w4_call(p, x, "dequant"), ref))
                        add("w4_dequant_alone", ctx.time_us(lambda x=x, p=p: w4_call(p, x, "dequant_alone")))
                    del p
            if m in ctx.fp8_ms:
                p8 = make_fp8(ctx, n, k)
                ref = x.float() @ p8["w_deq"].t()
                for quant in ("fused", "torch"):
                    call = functools.partial(fp8_call, ctx, p8, x, quant)
                    add(f"fp8_{quant}_quant", ctx.time_us(call), rel_err(call(), ref))
                from pagedllm.plugins.quantization.fp8.kernel import quantize_per_token

                add("fp8_quant_kernel_alone", ctx.time_us(lambda x=x: quantize_per_token(x)))
                del p8
        if not ctx.dry_run:
            torch.cuda.synchronize()
        row.update({f"speedup_{key}": row["bf16"] / v for key, v in list(row.items())
                    if key not in ("bf16", "fp8_quant_kernel_alone", "w4_dequant_alone")})
        out[f"m{m}"] = {"us": row, "rel_err": err}


def print_summary(results: dict[str, Any]) -> None:
    print(json.dumps(results.get("agreement", {}), indent=1))
    for key, r in results.get("layer_us", {}).items():
        us, err = r["us"], r["rel_err"]
        cells = [f"bf16 {us['bf16']:.1f}"] + [
            f"{name} {us[name]:.1f} ({us.get('speedup_' + name, 0):.2f}x, err {err[name]:.1e})"
            for name in us if not name.startswith("speedup_") and name != "bf16" and name in err
        ]
        if "fp8_quant_kernel_alone" in us:
            cells.append(f"fp8 quant kernel alone {us['fp8_quant_kernel_alone']:.1f}")
        for name in ("bf16_kn", "w4_dequant_alone"):
            if name in us:
                cells.append(f"{name} {us[name]:.1f}")
        print(f"{key:>6} µs/layer: " + " | ".join(cells))
    for shape, t in results.get("tuning_gemv_m1", {}).items():
        print("tuning_gemv_m1", shape, "best", t["best"], f"{t['best_us']:.1f}us",
              "default", t["default"], f"{t['default_us']:.1f}us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="one GEMV tile in the tuning grid")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = parser.parse_args()
    if args.dry_run:
        ctx = Ctx("cpu", torch.float16, SHAPES_TINY, (1, 3, 16, 130), (1, 16), True, args.quick)
    else:
        ctx = Ctx("cuda", torch.bfloat16, SHAPES_8B, (1, 2, 4, 8, 16, 128, 2048, 8192), (1, 16, 2048, 8192), False,
                  args.quick)
    import triton

    results: dict[str, Any] = {"device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
                               "torch": torch.__version__, "triton": triton.__version__}
    for stage in (agreement, tuning, speed):
        t0 = time.time()
        try:
            stage(ctx, results)
        except Exception as exc:  # keep the other stages' numbers
            import traceback

            results[f"{stage.__name__}_error"] = traceback.format_exc()[-3000:]
            print(f"{stage.__name__} failed: {exc}", file=sys.stderr)
        results[f"{stage.__name__}_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print_summary(results)
    if any(key.endswith("_error") for key in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
