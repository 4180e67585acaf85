"""The tensor-core W4A16 GEMV (plugins/quantization/w4a16/mma.py): correctness, then speed on the 8B shapes.

    python examples/gpu/w4_mma_check.py --out $OUT/w4_mma.json      # one H200, < 120 s

1. Correctness against x @ dequantize(...) in float32 (w4a16_layout.dequantize is the reference): M = 1..8,
   bf16 and fp16, group 128 / 32 / one group per row, GPTQ v1 and v2 zero offsets, N = 192 and the 8B shapes;
   split-K launches run twice and must give the same bits. Max relative error must stay under the
   activation dtype's rounding (bf16 8e-3, fp16 1e-3) or the script exits non-zero.
2. Speed at M = 1 per 8B layer shape: bf16 F.linear (cuBLAS), the Triton `mant` GEMV at its tuned blocks, and
   the mma kernel over a grid of (warps, iters, unroll); M = 2, 4, 8 at the default blocks. Timing as
   w4_gemv_sweep.py: CUDA graphs of ~100 calls over rotating weight copies past L2, median of 5 replays.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4_gemv_sweep import GROUP, ROTATE_BYTES, SHAPES_8B, Timer, make_weights  # noqa: E402

BLOCKS = [(4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (4, 16, 4), (8, 4, 2), (8, 8, 2), (4, 8, 1), (4, 16, 1),
          (4, 32, 2), (4, 32, 4), (8, 8, 4), (8, 16, 4), (2, 16, 4), (2, 32, 4), (8, 4, 4), (4, 4, 4), (16, 4, 4),
          (16, 2, 2), (8, 2, 2), (16, 4, 2)]
# (cols, zfold, pdl[, dq, probe]): MmaBlocks' fields after the first three; --features picks others
FEATURES = [(4, 1, 1, 1), (4, 1, 1, 0), (4, 0, 1, 1), (2, 1, 1, 1), (4, 1, 0, 1)]


def check_one(n: int, k: int, m: int, dtype: torch.dtype, group: int, zero_offset: int,
              features: tuple[int, ...] = (4, 1, 1, 1)) -> dict[str, Any]:
    from pagedllm.plugins.quantization.w4a16.layout import (
        PackedLayout,
        dequantize,
        pack_along_columns,
        pack_along_rows,
    )
    from pagedllm.plugins.quantization.w4a16.mma import mma_blocks, mma_reason, w4a16_mma_gemv

    group = group if group > 0 else k
    q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32)
    z = torch.randint(zero_offset, 16, (k // group, n), device="cuda", dtype=torch.int32)
    s = (torch.rand(k // group, n, device="cuda") * 0.02 + 0.001).to(dtype)
    layout = PackedLayout("gptq", 4, group, zero_offset)
    qw, qz = pack_along_rows(q, 4), pack_along_columns(z - zero_offset, 4)
    x = torch.randn(m, k, device="cuda").to(dtype)
    reason = mma_reason(layout, x, s, qw, n)
    rec: dict[str, Any] = {"n": n, "k": k, "m": m, "dtype": str(dtype), "group": group, "zero_offset": zero_offset,
                           "features": list(features)}
    if reason:
        rec["refused"] = reason
        return rec
    ref = x.float() @ dequantize(layout, qw, qz, s, dtype=torch.float32)
    blocks = mma_blocks(layout, m, n, k)
    blocks = blocks._replace(**dict(zip(blocks._fields[3:], features)))
    y = w4a16_mma_gemv(x, layout, qw, qz, s, n, blocks)
    rec["blocks"] = list(blocks)
    rec["err"] = float((y.float() - ref).abs().max() / ref.abs().max())
    rec["same_bits_twice"] = bool(torch.equal(y, w4a16_mma_gemv(x, layout, qw, qz, s, n, blocks)))
    if n % 64 == 0 and not blocks.probe:  # [gate | up] -> silu(gate) * up in the epilogue (w4a16_mma.cu NOTE 5)
        gate, up = y.float().chunk(2, dim=-1)
        act = (gate / (1 + torch.exp(-gate))).to(dtype).float() * up
        yg = w4a16_mma_gemv(x, layout, qw, qz, s, n, blocks, gated=True)
        rec["gated_err"] = float((yg.float() - act).abs().max() / act.abs().max())
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="w4_mma.json")
    ap.add_argument("--skip-grid", action="store_true", help="only the default blocks in stage 2")
    ap.add_argument("--features", default="", help='e.g. "4,1,1,1;4,1,1,0;4,1,1,1,2" (cols, zfold, pdl, dq, probe)')
    args = ap.parse_args()
    features = [tuple(int(v) for v in f.split(",")) for f in args.features.split(";")] if args.features else FEATURES
    from pagedllm.plugins.quantization.w4a16.gemv import w4a16_gemv
    from pagedllm.plugins.quantization.w4a16.mma import MmaBlocks, mma_blocks, w4a16_mma_gemv, w4a16_mma_rows

    torch.manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "speed": []}
    bad = []
    cases = [((192, 256), m, dt, g, zo) for m in (1, 2, 3, 5, 8) for dt in (torch.bfloat16, torch.float16)
             for g, zo in ((128, 1), (32, 0), (-1, 1))]
    cases += [(shape, m, torch.bfloat16, 128, 1) for shape in SHAPES_8B.values() for m in (1, 4, 8)]
    for (n, k), m, dtype, group, zo in cases:
        checked = [f for f in features if len(f) < 5 or not f[4]]  # probes compute wrong results on purpose
        for feat in checked if (n, k) == (192, 256) or m == 1 else checked[:1]:
            rec = check_one(n, k, m, dtype, group, zo, feat)
            out["checks"].append(rec)
            bound = 8e-3 if dtype == torch.bfloat16 else 1e-3
            if "refused" in rec or rec["err"] > bound or not rec["same_bits_twice"] or rec.get("gated_err", 0) > bound:
                bad.append(rec)
    print(f"checks: {len(out['checks'])}, failed {len(bad)}; max err bf16 "
          f"{max(r.get('err', 0) for r in out['checks'] if 'bfloat16' in r['dtype']):.2e}, fp16 "
          f"{max(r.get('err', 0) for r in out['checks'] if 'float16' in r['dtype'] and 'bfloat' not in r['dtype']):.2e}")
    for r in bad[:10]:
        print("FAILED", r)

    timer = Timer(False)
    layer = {"bf16": 0.0, "mant": 0.0, "mma_default": 0.0, "mma_best": 0.0, "mma_m16": 0.0, "gemm_m16": 0.0}
    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_gemm

    for name, (n, k) in SHAPES_8B.items():
        packed_bytes = n * k // 2 + n * k // GROUP * 5 // 2
        w = make_weights(n, k, "cuda", torch.bfloat16, math.ceil(ROTATE_BYTES / packed_bytes))
        del w["w_t"]
        lay = w["layout"]
        x1 = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        w16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        ws = [w16] + [w16.clone() for _ in range(math.ceil(ROTATE_BYTES / w16.nbytes) - 1)]
        rec: dict[str, Any] = {"shape": name, "n": n, "k": k}
        rec["bf16_us"] = timer.us_per_call([functools.partial(F.linear, x1, ww) for ww in ws])
        del ws, w16
        rec["mant_us"] = timer.us_per_call(
            [functools.partial(w4a16_gemv, x1, lay, *st, n, variant="mant") for st in w["sets"]])
        default = tuple(mma_blocks(lay, 1, n, k, x1.device))[:3]
        grid = [default] if args.skip_grid else [default] + [g for g in BLOCKS if g != default]
        rec["mma"] = {}
        key_feat: dict[str, tuple[int, ...]] = {}
        for feat in features:
            for blocks3 in grid:
                if k // 32 % blocks3[2] or blocks3[1] % blocks3[2]:
                    continue
                blocks = MmaBlocks(*blocks3, *feat)
                key = str(tuple(blocks))
                key_feat[key] = feat
                try:
                    rec["mma"][key] = timer.us_per_call(
                        [functools.partial(w4a16_mma_gemv, x1, lay, *st, n, blocks) for st in w["sets"]])
                except Exception as exc:  # noqa: BLE001 -- a refused config is recorded, not fatal
                    rec["mma"][key] = f"{type(exc).__name__}: {exc}"[:200]
        rec["by_features"] = {}
        for feat in features:
            got = {b: v for b, v in rec["mma"].items() if isinstance(v, float) and key_feat[b] == feat}
            if got:
                best_b = min(got, key=got.__getitem__)
                rec["by_features"][str(feat)] = (best_b, got[best_b])
        print(f"{name}: best per features: " + "; ".join(f"{f} {v[1]:.1f}" for f, v in rec["by_features"].items()),
              flush=True)
        default = str(tuple(mma_blocks(lay, 1, n, k, x1.device)))
        times = {b: v for b, v in rec["mma"].items() if isinstance(v, float) and not any(key_feat[b][4:5])}
        best = min(times, key=times.__getitem__)
        rec["mma_default_us"], rec["mma_best"], rec["mma_best_us"] = times[default], best, times[best]
        for m in (2, 4, 8, 16):
            xm = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rec[f"mma_m{m}_us"] = timer.us_per_call(
                [functools.partial(w4a16_mma_rows, xm, lay, *st, n) for st in w["sets"]])
            rec[f"mant_m{m}_us"] = timer.us_per_call(
                [functools.partial(w4a16_gemv, xm, lay, *st, n) for st in w["sets"][:4]]) if m <= 4 else None
        if name == "gate_up":  # SiLU-and-mul in the epilogue vs the GEMV then the Triton act_and_mul kernel
            from pagedllm.layers.triton_ops import act_and_mul

            rec["gated_us"] = timer.us_per_call(
                [functools.partial(w4a16_mma_gemv, x1, lay, *st, n, gated=True) for st in w["sets"]])
            rec["gemv_then_act_us"] = timer.us_per_call(
                [lambda st=st, x1=x1, lay=lay, n=n: act_and_mul(w4a16_mma_gemv(x1, lay, *st, n)) for st in w["sets"]])
            print(f"gate_up + SiLU-and-mul: fused {rec['gated_us']:.1f} us, GEMV then act_and_mul "
                  f"{rec['gemv_then_act_us']:.1f} us", flush=True)
        x16 = torch.randn(16, k, device="cuda").to(torch.bfloat16)
        rec["gemm_m16_us"] = timer.us_per_call(  # the route mma_rows replaces at 9..16 rows
            [functools.partial(w4a16_gemm, x16, lay, *st, None, n) for st in w["sets"]])
        rec["mma_tb_s"] = w["bytes"] / rec["mma_best_us"] / 1e6
        out["speed"].append(rec)
        layer["bf16"] += rec["bf16_us"]
        layer["mant"] += rec["mant_us"]
        layer["mma_default"] += rec["mma_default_us"]
        layer["mma_best"] += rec["mma_best_us"]
        layer["mma_m16"] += rec["mma_m16_us"]
        layer["gemm_m16"] += rec["gemm_m16_us"]
        print(f"{name:8s} bf16 {rec['bf16_us']:6.1f}  mant {rec['mant_us']:6.1f}  mma default {default} "
              f"{rec['mma_default_us']:6.1f}  best {best} {rec['mma_best_us']:6.1f} ({rec['mma_tb_s']:.2f} TB/s)  "
              f"M=2/4/8/16 {rec['mma_m2_us']:.1f}/{rec['mma_m4_us']:.1f}/{rec['mma_m8_us']:.1f}/{rec['mma_m16_us']:.1f}"
              f" (GEMM at 16: {rec['gemm_m16_us']:.1f})", flush=True)
        del w
        torch.cuda.empty_cache()
    out["layer_us"] = layer
    print("layer µs: " + ", ".join(f"{k} {v:.1f}" for k, v in layer.items()))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
