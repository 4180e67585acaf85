"""The dense decode GEMV's blocks on small hidden sizes (issue 29): the rule's choice against the blocks chosen
before it, per linear of Llama-3.2-1B, Qwen3-4B and Llama-3.1-8B at M = 1 (and of the other shapes of
model_shapes.py, which the rule reaches unfitted), and the greedy argmax kernel against torch's; one H200,
one process, no engine.

    python3 -m pip install -e . --no-deps --no-build-isolation -q
    python3 examples/gpu/small_gemv_check.py --out $OUT/small_gemv.json             # H200, ~10 s of GPU
    python3 examples/gpu/small_gemv_check.py --explore --out $OUT/small_gemv.json   # + a grid per 1B/4B shape, ~30 s
    python examples/gpu/small_gemv_check.py --dry-run --out /tmp/small_gemv.json   # CPU, Triton interpreter

  1. per shape: cuBLAS, the old blocks (OLD_TABLE / old_default_blocks below: what main chose before the rule)
     and the new ones (dense_gemv.gemv_blocks' choice), timed A B A B in one process (the faster of each
     pair's two medians), TB/s = weight bytes / time; each new point's error against a float32 reference
  2. the verdict: a shape switches only where new <= old + NOISE; elsewhere the script prints the GEMV_TABLE pin that
     keeps the old blocks (paste it into core/layers/dense_gemv.py), and per model the
     GEMV time of one token (layers x four linears + the LM head), old against new, and its TB/s
  3. --explore: a grid of (BLOCK_N, BLOCK_K, warps, split) for each 1B / 4B shape while the budget lasts;
     the best point per shape is printed beside the rule's
  4. argmax: torch.argmax against argmax_kernel.argmax_rows on bf16 [B, V] logits with planted ties; the
     index must be equal, timed as in 1
Timing: gemv_sweep's Timer (a CUDA graph of ~100 calls, weights rotated past 256 MB so each call reads HBM).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gemv_sweep import err_of, make_weights, read_bandwidth_gbs  # noqa: E402
from gemv_sweep import sms as device_sms  # noqa: E402
from w4_gemv_sweep import Timer  # noqa: E402

Blocks = tuple[int, int, int, int]
# (N, K) per linear at M = 1, and the layer count (model_shapes.py's published configs)
MODELS: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {
    "llama-3.2-1b": (16, {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                          "down": (2048, 8192), "lm_head": (128256, 2048)}),
    "qwen3-4b": (36, {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560),
                      "down": (2560, 9728), "lm_head": (151936, 2560)}),
    "llama-3.1-8b": (32, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                          "down": (4096, 14336), "lm_head": (128256, 4096)}),
    # the other shapes of model_shapes.py, which the rule also reaches (not fitted on them)
    "qwen2.5-7b": (28, {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
                        "down": (3584, 18944), "lm_head": (152064, 3584)}),
    "gemma-2-2b": (26, {"qkv": (4096, 2304), "o": (2304, 2048), "gate_up": (18432, 2304),
                        "down": (2304, 9216), "lm_head": (256000, 2304)}),
    "mistral-7b-v0.3": (32, {"lm_head": (32768, 4096)}),  # its layers are the 8B's
}
TINY: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {
    "tiny": (2, {"qkv": (192, 256), "o": (128, 256), "gate_up": (320, 256), "down": (128, 512),
                 "lm_head": (1000, 256)}),
}
# What main chose before the rule (dense_gemv.py at c12e4bf): the 8B sweep's M = 1 entries, else the default.
OLD_TABLE: dict[tuple[int, int], Blocks] = {
    (6144, 4096): (4, 1024, 4, 1), (4096, 4096): (4, 1024, 4, 1), (28672, 4096): (4, 2048, 8, 1),
    (4096, 14336): (4, 1024, 4, 1), (128256, 4096): (16, 1024, 4, 1),
}
ROTATE_BYTES = 256 << 20
BUDGET_S = 200.0  # the explore grid takes no new point after this
# Graph medians of one shape repeat within ~0.5 % (the explore grid's equal points); gemv_sweep.py's WIN allows 2 %.
NOISE = 0.01
ARGMAX_CASES = ((1, 128256), (1, 151936), (4, 128256), (16, 151936), (64, 128256))


def old_default_blocks(n: int, k: int, sms: int) -> Blocks:
    """dense_gemv.default_blocks at M = 1 as it was: 8 rows, BLOCK_K 1024, K split to ~8 programs per SM."""
    from pagedllm.layers.dense_gemv import split_for

    block_k = 1024
    while block_k > 8 and block_k >= 2 * k:
        block_k //= 2
    return 8, block_k, max(1, min(4, block_k // 256)), split_for(n, k, 8, block_k, 8 * sms)


def old_blocks(n: int, k: int, sms: int) -> Blocks:
    return OLD_TABLE.get((n, k)) or old_default_blocks(n, k, sms)


def new_blocks(n: int, k: int, sms: int) -> Blocks | None:
    from pagedllm.layers.dense_gemv import choose_blocks

    got = choose_blocks(1, n, k, sms)
    return None if got is None else tuple(got)  # type: ignore[return-value]


def grid(n: int, k: int, sms: int, dry: bool) -> list[Blocks]:
    """BLOCK_N 4..32 x BLOCK_K 512..2048 (unmasked where one divides K) x split 1, 2, 4 (whole steps)."""
    if dry:
        return [(8, 128, 1, 1), (4, 64, 1, 2)]
    widths = [bk for bk in (512, 1024, 2048) if k % bk == 0] or [512, 1024]
    points: list[Blocks] = []
    for bn in (4, 8, 16, 32):
        for bk in widths:
            steps = -(-k // bk)
            for split in (1, 2, 4):
                if split <= steps and (bn, bk, bk // 256, split) not in points:
                    points.append((bn, bk, bk // 256, split))
    return points


class Bench:
    """One shape's weights (rotated copies), x, reference; times cuBLAS and GEMV blocks on them."""

    def __init__(self, n: int, k: int, device: str, dtype: torch.dtype, dry: bool) -> None:
        copies = 1 if dry else math.ceil(ROTATE_BYTES / (2 * n * k))
        self.ws = make_weights(n, k, device, dtype, copies)
        self.x = torch.randn(1, k, device=device).to(dtype)
        self.ref = self.x.float() @ self.ws[0].float().T
        self.bytes = self.ws[0].nbytes + self.x.nbytes + n * self.x.element_size()

    def fns(self, blocks: Blocks | None) -> list[Callable[[], torch.Tensor]]:
        from pagedllm.layers.dense_gemv_kernel import dense_gemv

        x = self.x
        if blocks is None:
            return [lambda w=w: F.linear(x, w) for w in self.ws]
        return [lambda w=w: dense_gemv(x, w, None, blocks) for w in self.ws]

    def err(self, blocks: Blocks | None) -> float:
        return err_of(self.fns(blocks)[0](), self.ref)


def a_b(timer: Timer, fa: list[Callable[[], Any]], fb: list[Callable[[], Any]]) -> tuple[float, float]:
    """A B A B in one process: the faster of each side's two graph medians (drift between them cancels)."""
    a1, b1, a2, b2 = (timer.us_per_call(f) for f in (fa, fb, fa, fb))
    return min(a1, a2), min(b1, b2)


def check_shapes(args: argparse.Namespace, timer: Timer, t_start: float, sms: int) -> dict[str, Any]:
    dry = args.dry_run
    device, dtype = ("cpu", torch.float16) if dry else ("cuda", torch.bfloat16)
    models = TINY if dry else MODELS
    out: dict[str, Any] = {"rows": {}, "pins": {}, "per_token": {}, "explore": {}}
    torch.manual_seed(0)
    explore_later: list[tuple[str, int, int]] = []
    for model, (layers, shapes) in models.items():
        tot_old = tot_new = tot_bytes = 0.0
        for name, (n, k) in shapes.items():
            bench = Bench(n, k, device, dtype, dry)
            old, new = old_blocks(n, k, sms), new_blocks(n, k, sms)
            cublas_us = timer.us_per_call(bench.fns(None))
            old_us, new_us = a_b(timer, bench.fns(old), bench.fns(new)) if new != old else (
                (timer.us_per_call(bench.fns(old)),) * 2)
            switch = new_us <= old_us * (1 + NOISE)
            row = {"old": list(old), "new": list(new) if new else None, "cublas_us": round(cublas_us, 2),
                   "old_us": round(old_us, 2), "new_us": round(new_us, 2), "new_over_old": round(new_us / old_us, 3),
                   "old_tb_s": round(bench.bytes / old_us / 1e6, 3), "new_tb_s": round(bench.bytes / new_us / 1e6, 3),
                   "new_err": bench.err(new), "switch": switch}
            key = f"{model}/{name}"
            out["rows"][key] = row
            print(f"[{key}] {json.dumps(row)}", flush=True)
            if not switch:
                out["pins"][f"(1, {n}, {k})"] = list(old)
            times_layers = 1 if name == "lm_head" else layers
            tot_old += times_layers * old_us
            tot_new += times_layers * (new_us if switch else old_us)
            tot_bytes += times_layers * bench.bytes
            if model in ("llama-3.2-1b", "qwen3-4b", "tiny"):
                explore_later.append((key, n, k))
            del bench
            if not dry:
                torch.cuda.empty_cache()
        if len(shapes) < 5:  # an LM head alone is no token's worth
            continue
        out["per_token"][model] = {"old_us": round(tot_old, 1), "new_us": round(tot_new, 1),
                                   "old_tb_s": round(tot_bytes / tot_old / 1e6, 3),
                                   "new_tb_s": round(tot_bytes / tot_new / 1e6, 3)}
    if args.explore or dry:
        for key, n, k in explore_later:
            bench = Bench(n, k, device, dtype, dry)
            pts = []
            for blocks in grid(n, k, sms, dry):
                if time.time() - t_start > BUDGET_S:
                    break
                try:
                    pts.append((timer.us_per_call(bench.fns(blocks)), list(blocks)))
                except Exception as exc:  # a config the compiler refuses: recorded, not fatal
                    pts.append((float("inf"), list(blocks) + [f"{type(exc).__name__}"]))
            pts.sort(key=lambda p: p[0])
            out["explore"][key] = [[round(us, 2), b] for us, b in pts]
            if pts:
                print(f"[explore {key}] best {pts[0][1]} {pts[0][0]:.2f} us; "
                      f"top5 {[(round(u, 2), b) for u, b in pts[:5]]}", flush=True)
            del bench
            if not dry:
                torch.cuda.empty_cache()
    return out


def check_argmax(args: argparse.Namespace, timer: Timer) -> dict[str, Any]:
    from pagedllm.sample.argmax_kernel import argmax_rows

    dry = args.dry_run
    device, dtype = ("cpu", torch.float16) if dry else ("cuda", torch.bfloat16)
    out: dict[str, Any] = {}
    for b, v in ((2, 9000),) if dry else ARGMAX_CASES:
        logits = torch.randn(b, v, device=device).to(dtype)
        logits[:, 5] = logits[:, v - 7] = 30.0  # a planted tie: the lowest index (5) wins
        if b > 1:
            logits[1:, 5] = -30.0  # other rows: the tie's second member
        rows = [logits.clone() for _ in range(8)]
        t_us, k_us = a_b(timer, [lambda r=r: r.argmax(dim=-1) for r in rows], [lambda r=r: argmax_rows(r) for r in rows])
        equal = bool(torch.equal(argmax_rows(logits), logits.argmax(dim=-1)))
        out[f"{b}x{v}"] = {"torch_us": round(t_us, 2), "kernel_us": round(k_us, 2), "equal": equal}
        print(f"[argmax {b}x{v}] {json.dumps(out[f'{b}x{v}'])}", flush=True)
    return out


def print_report(out: dict[str, Any]) -> None:
    print(f"read-only stream {out.get('read_bandwidth_gbs')} GB/s, SMs {out['sms']}")
    print(f"{'shape':<24}{'cuBLAS':>8}{'old us':>8}{'new us':>8}{'new/old':>8}{'new TB/s':>9}  old -> new blocks")
    for key, r in out["shapes"]["rows"].items():
        verdict = "" if r["switch"] else f"  REFUSED: new slower by > {NOISE:.0%}, old pinned"
        print(f"{key:<24}{r['cublas_us']:>8.1f}{r['old_us']:>8.1f}{r['new_us']:>8.1f}{r['new_over_old']:>8.3f}"
              f"{r['new_tb_s']:>9.2f}  {r['old']} -> {r['new']}{verdict}")
    for model, t in out["shapes"]["per_token"].items():
        print(f"{model}: GEMVs of one token {t['old_us']} -> {t['new_us']} us ({t['old_tb_s']} -> {t['new_tb_s']} TB/s)")
    if out["shapes"]["pins"]:
        print("GEMV_TABLE pins for the refused shapes (dense_gemv.py):")
        for key, blocks in out["shapes"]["pins"].items():
            print(f"    {key}: DenseGemvBlocks{tuple(blocks)},")
    for case, r in out.get("argmax", {}).items():
        print(f"argmax {case}: torch {r['torch_us']} us, kernel {r['kernel_us']} us, equal {r['equal']}")
    print(f"total {out['total_s']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON path (e.g. $OUT/small_gemv.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--explore", action="store_true", help="also a grid of blocks per 1B / 4B shape")
    args = parser.parse_args()
    t_start = time.time()
    timer = Timer(args.dry_run)
    sms = device_sms()  # 132 (the H200's) without CUDA: the dry run's shapes
    out: dict[str, Any] = {"device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
                           "torch": torch.__version__, "sms": sms}
    if not args.dry_run:
        out["read_bandwidth_gbs"] = round(read_bandwidth_gbs(), 1)
    out["argmax"] = check_argmax(args, timer)
    out["shapes"] = check_shapes(args, timer, t_start, sms)
    out["total_s"] = time.time() - t_start
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print_report(out)


if __name__ == "__main__":
    main()
