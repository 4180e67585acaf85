"""GGUF kept quantized on CUDA (plugins/quantization/gguf/triton_gemm.py) against bf16: per matrix and in the engine.

    python examples/gpu/gguf_bench.py --out $OUT/gguf.json                  # H200, < 4 minutes
    python examples/gpu/gguf_bench.py --stages block --out $OUT/gguf_block.json   # H200, stage 4 alone, < 150 s
    python examples/gpu/gguf_bench.py --dry-run --out /tmp/gguf.json        # CPU, Triton interpreter, tiny shapes

  1. exactness on the GPU: gguf_dequantize (float32) of each type against gguf-py's numpy dequantization of
     the same random blocks (the interpreter tests prove the kernel's arithmetic; this counts what FMA
     contraction on the real compiler changes)
  2. per matrix, µs per call: the Llama-3.1-8B layer shapes (qkv 6144x4096, o, gate_up 28672x4096, down
     4096x14336) in Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and the SmolLM2-135M layer + LM head in Q4_1 / Q8_0, at
     M = 1, 4, 8 (the GEMV) and 2048 (dequantize to scratch + cuBLAS; the dequantization alone beside it),
     against bf16 F.linear on the same shapes; error = max |y - ref| / max |ref| with ref = x @ W (float32)
  3. the engine: the embedded SmolLM2 Q4_1 GGUF, batch 1, greedy, 128 tokens, dequantized at load (the CUDA
     default) vs `quantization="gguf"` (the Triton kernels): decode tok/s, resident weight bytes, same tokens?
  4. the block-wise GEMV (gguf/block_gemv.py) beside the element-wise one (gguf/triton_gemm.py's, forced with its
     tiles) and bf16 F.linear: Llama-3.1-8B qkv, o, gate_up, down and the 128,256 x 4096 LM head in Q4_0, Q4_1,
     Q8_0 at M = 1, 2, 4; µs per call, weight GB/s, error of each against x @ W (float32), and per 8B layer
     (qkv + o + gate_up + down) the sum. Predictions: docs/perf-notes.md §8, "Second pass".
Timing: a CUDA graph of ~100 calls replayed 5 times (median), rotating over copies of the weight that together
exceed 256 MB, so each call reads its weight from HBM as a decode step does. Random blocks: random bytes with
every f16 scale field set to a small positive value (the code bits are all valid). Predictions:
docs/perf-notes.md §8.
--dry-run: tiny shapes, float16, Triton interpreter, one call per point, no engine stage (checks the script).
The engine on the Llama-3.1-8B shape with random Q4_0 blocks (single-stream decode against bf16):
`python examples/gpu/bench_suite.py --quantization gguf-q4_0 --workloads W3 --compare-bf16 W3`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from w4_gemv_sweep import Timer  # noqa: E402  (CUDA-graph replays over weight copies past L2)

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SHAPES_SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SHAPES_TINY = {"qkv": (48, 512), "down": (32, 768)}
TYPES_8B = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
# f16 fields (byte offsets in a block) that scale the codes: set to small positive values in random blocks.
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
ROTATE_BYTES = 256 << 20


def random_blocks(name: str, n: int, k: int, device: str, seed: int) -> torch.Tensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qk, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // qk, ts), dtype=torch.uint8, device=device, generator=g)
    for off in SCALE_FIELDS[name]:
        d = (torch.rand(n, k // qk, 1, device=device, generator=g) * 0.01 + 1e-4).half()
        raw[..., off : off + 2] = d.view(torch.uint8)
    return raw.reshape(n, -1)


def rotated_block_sets(name: str, n: int, k: int, device: str, seed: int, dry_run: bool) -> list[torch.Tensor]:
    """Enough random copies of one [n, k] matrix in `name` blocks that rotating through them defeats L2."""
    first = random_blocks(name, n, k, device, seed)
    copies = 1 if dry_run else max(2, math.ceil(ROTATE_BYTES / first.numel()))  # uint8: numel = bytes
    return [first] + [random_blocks(name, n, k, device, seed + 100 * c) for c in range(1, copies)]


def exactness(device: str) -> dict[str, Any]:
    """Stage 1: mismatching weights per type (GPU float32 dequantization vs gguf-py's numpy)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedllm.plugins.quantization.gguf.triton_gemm import gguf_dequantize

    out = {}
    for i, name in enumerate(SCALE_FIELDS):
        t = GGMLQuantizationType[name]
        blocks = random_blocks(name, 64, 512, device, i)
        ref = torch.from_numpy(dequantize(blocks.cpu().numpy(), t).reshape(64, 512))
        got = gguf_dequantize(blocks, int(t), 512, torch.float32).cpu()
        out[name] = {"mismatches": int((got != ref).sum()), "max_abs_diff": float((got - ref).abs().max())}
    return out


def matrices(args: argparse.Namespace, timer: Timer, device: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Stage 2: µs per call, GGUF kernels vs bf16, per shape, type and M."""
    from gguf import GGMLQuantizationType

    from pagedllm.plugins.quantization.gguf.triton_gemm import gguf_dequantize, gguf_matmul

    plan: list[tuple[str, dict[str, tuple[int, int]], list[str], tuple[int, ...]]]
    if args.dry_run:
        plan = [("tiny", SHAPES_TINY, ["Q4_0", "Q4_K"], (1, 4, 16))]
    else:
        plan = [("8b", SHAPES_8B, TYPES_8B, (1, 4, 8, 2048)),
                ("smollm2", SHAPES_SMOLLM2, ["Q4_1"], (1, 8, 2048)),
                ("smollm2", {"lm_head": (49152, 576)}, ["Q8_0"], (1, 8))]
    rows = []
    for model, shapes, types, ms in plan:
        for shape_name, (n, k) in shapes.items():
            dense_bytes = n * k * 2
            copies = 1 if args.dry_run else max(2, math.ceil(ROTATE_BYTES / dense_bytes))
            dense = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=dtype)
                bf16_us = timer.us_per_call([functools.partial(F.linear, x, w) for w in dense])
                for ti, name in enumerate(types):
                    t = int(GGMLQuantizationType[name])
                    sets = rotated_block_sets(name, n, k, device, ti, args.dry_run)
                    qbytes = sets[0].numel()
                    y = gguf_matmul(x, sets[0], t, n)
                    ref = x.float() @ gguf_dequantize(sets[0], t, k, torch.float32).t()
                    err = float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                    us = timer.us_per_call([functools.partial(gguf_matmul, x, b, t, n) for b in sets])
                    row = {"model": model, "shape": shape_name, "n": n, "k": k, "m": m, "type": name,
                           "us": round(us, 2), "bf16_us": round(bf16_us, 2), "speedup_vs_bf16": round(bf16_us / us, 3),
                           "weight_gb_s": round(qbytes / us / 1e3, 1), "err": err}
                    if m > 8:
                        row["dequant_alone_us"] = round(timer.us_per_call(
                            [functools.partial(gguf_dequantize, b, t, k, dtype) for b in sets]), 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del sets
            del dense
    return rows


def block_gemv(args: argparse.Namespace, timer: Timer, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Stage 4: µs per call, block-wise vs element-wise GEMV vs bf16, the 8B shapes (module doc)."""
    from gguf import GGMLQuantizationType

    from pagedllm.plugins.quantization.gguf.block_gemv import block_tiles, gguf_block_gemv
    from pagedllm.plugins.quantization.gguf.triton_gemm import gemv_blocks, gguf_dequantize, gguf_gemv

    ms: tuple[int, ...]
    if args.dry_run:
        shapes, types, ms = SHAPES_TINY, ["Q4_0"], (1, 4)
    else:
        shapes, types, ms = SHAPES_8B | {"lm_head": (128256, 4096)}, ["Q4_0", "Q4_1", "Q8_0"], (1, 2, 4)
    rows: list[dict[str, Any]] = []
    for shape_name, (n, k) in shapes.items():
        copies = 1 if args.dry_run else max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
        dense = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in ms}
        bf16_us = {m: round(timer.us_per_call([functools.partial(F.linear, xs[m], w) for w in dense]), 2) for m in ms}
        del dense
        for ti, name in enumerate(types):
            t = int(GGMLQuantizationType[name])
            sets = rotated_block_sets(name, n, k, device, ti, args.dry_run)
            qbytes = sets[0].numel()
            w32 = gguf_dequantize(sets[0], t, k, torch.float32)
            for m in ms:
                x = xs[m]
                ref = x.float() @ w32.t()
                scale = float(ref.abs().max().clamp(min=1e-30))
                tiles = gemv_blocks(n, m)
                row: dict[str, Any] = {"shape": shape_name, "n": n, "k": k, "m": m, "type": name,
                                       "block_tiles": list(block_tiles(n, k, m))}
                for label, fn in (("block", functools.partial(gguf_block_gemv)),
                                  ("elementwise", functools.partial(gguf_gemv, tiles=tiles))):
                    y = fn(x, sets[0], t, n)
                    row[f"{label}_err"] = float((y.float() - ref).abs().max()) / scale
                    us = timer.us_per_call([functools.partial(fn, x, b, t, n) for b in sets])
                    row[f"{label}_us"] = round(us, 2)
                    row[f"{label}_gb_s"] = round(qbytes / us / 1e3, 1)
                row["bf16_us"] = bf16_us[m]
                row["block_vs_elementwise"] = round(row["elementwise_us"] / row["block_us"], 2)
                row["block_vs_bf16"] = round(row["bf16_us"] / row["block_us"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del sets, w32
    layers = []  # per 8B decoder layer: the four matrices summed
    for name in types:
        for m in ms:
            pick = [r for r in rows if r["type"] == name and r["m"] == m and r["shape"] in SHAPES_8B]
            if len(pick) == len(SHAPES_8B):
                layers.append({"type": name, "m": m, **{f"layer_{key}": round(sum(r[key] for r in pick), 1)
                                                        for key in ("block_us", "elementwise_us", "bf16_us")}})
    print("\n type  M  layer µs: block  element-wise  bf16   (block vs bf16)")
    for lay in layers:
        print(f" {lay['type']:5} {lay['m']}  {lay['layer_block_us']:16} {lay['layer_elementwise_us']:13} "
              f"{lay['layer_bf16_us']:6}   {lay['layer_bf16_us'] / lay['layer_block_us']:.2f}x", flush=True)
    return {"rows": rows, "layers": layers}


def engine(max_tokens: int) -> dict[str, Any]:
    """Stage 3: the embedded SmolLM2 Q4_1 GGUF, dequantized at load vs kept quantized (Triton), batch 1."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = ["Write a short story about a lighthouse keeper who finds a message in a bottle."]
    out: dict[str, Any] = {}
    for label, kwargs in (("dequantized_at_load", {"device": "cuda", "gpu_memory_utilization": 0.3}),
                          ("gguf_triton", {"device": "cuda", "gpu_memory_utilization": 0.3, "quantization": "gguf"})):
        llm = LLM(**kwargs)
        weights = sum(t.numel() * t.element_size() for t in llm_tensors(llm))
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up: graphs, autotune
        t0 = time.perf_counter()
        res = llm.generate(prompt, params)
        wall = time.perf_counter() - t0
        tokens = list(res[0].outputs[0].token_ids)
        out[label] = {"tok_s": round(len(tokens) / wall, 1), "resident_weight_bytes": weights, "tokens": tokens}
        del llm
        torch.cuda.empty_cache()
    a, b = out["dequantized_at_load"]["tokens"], out["gguf_triton"]["tokens"]
    out["tokens_equal_before"] = next((i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q), len(a))
    return out


def llm_tensors(llm: Any) -> list[torch.Tensor]:
    """The model's parameters and buffers (GGUF kernels keep their blocks as buffers; rotary tables are tiny)."""
    model = llm.engine.parts.model
    return [*model.parameters(), *model.buffers()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="skip stage 3")
    ap.add_argument("--stages", default="exact,matrices,engine,block",
                    help="comma list of exact, matrices, engine, block (stages 1-4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float16 if args.dry_run else torch.bfloat16
    timer = Timer(args.dry_run)
    result: dict[str, Any] = {
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    stages = set(args.stages.split(","))
    if "exact" in stages:
        result["exactness"] = exactness(device)
        print(json.dumps(result["exactness"]), flush=True)
    if "matrices" in stages:
        result["matrices"] = matrices(args, timer, device, dtype)
    if "block" in stages:
        result["block_gemv"] = block_gemv(args, timer, device, dtype)
    if "engine" in stages and not args.dry_run and not args.no_engine:
        result["engine"] = engine(args.max_tokens)
        print(json.dumps({k: v for k, v in result["engine"].items() if k != "tokens"}, default=str), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
