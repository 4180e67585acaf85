"""The dense decode GEMV (core/layers/dense_gemv_kernel.py) against cuBLAS on the Llama-3.1-8B shapes, then W3
through the engine with the GEMV off and on; one H200, one process.

    python examples/gpu/gemv_sweep.py --out $OUT/gemv_sweep.json             # H200, < 200 s
    python examples/gpu/gemv_sweep.py --dry-run --out /tmp/gemv_sweep.json   # CPU, Triton interpreter

  0. ceilings: device copy bandwidth (read + write, bench_suite's method) and a read-only stream (a sum over
     2 GiB), the two anchors the GEMV's TB/s sits between
  1. cuBLAS (F.linear) per shape at M = 1, 2, 4: qkv 4096->6144, o 4096->4096, gate_up 4096->28672,
     down 14336->4096, lm_head 4096->128256, bf16; down_gated = SiLU-and-mul (Triton) + cuBLAS down, the
     two launches the gated GEMV replaces (dense_gemv NOTE 3)
  2. the GEMV per shape and M over GRID's (BLOCK_N, BLOCK_K, warps) x SPLIT_K for ~4 / 8 / 16 programs per SM
     (default blocks first, so a run cut short by the budget still has them); each point's error against a
     float32 reference and against cuBLAS's output, and its bits on a second call (split-K must repeat)
  3. the table: per shape and M the best GEMV against cuBLAS; the layer's four linears summed; GEMV_TABLE
     entries to paste into core/layers/dense_gemv.py (None where cuBLAS wins)
  4. W3 (1 x 128 in / 512 out, bench_suite's single_stream, median of 3) on one engine with the stage-3 table
     installed: GEMV off, on, on with the LM head on cuBLAS, on without the SiLU folded into down (graphs
     re-captured each time; the last two only while time remains); greedy tokens compared between off and
     on; a torch.profiler table of 8 decode steps with the GEMV on (kernels per step)
Timing (w4_gemv_sweep.Timer): a CUDA graph of ~100 calls replayed 5 times between events (median), cycling
over copies of the weight that together pass 256 MB, so every call reads its weight from HBM as a decode step
does. TB/s = (weight + x + y bytes) / time.
--dry-run: tiny shapes, float16, the interpreter, one call per point, no engine (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, cast

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from w4_gemv_sweep import Timer  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096), "down_gated": (4096, 14336)}
SHAPES_TINY = {"qkv": (192, 256), "o": (128, 256), "gate_up": (320, 256), "down": (128, 512), "lm_head": (512, 256),
               "down_gated": (128, 512)}
# down_gated: the down projection fed [gate | up] (dense_gemv NOTE 3), against SiLU-and-mul + cuBLAS (two launches)
GATED = {"down_gated"}
LAYERS = {"layer": ("qkv", "o", "gate_up", "down"), "layer_gated": ("qkv", "o", "gate_up", "down_gated")}
MS = (1, 2, 4)
ROTATE_BYTES = 256 << 20
BUDGET_S = 75.0  # stage 2 takes no new point after this; stage 4 needs ~50-80 s (engine build, four captures)
# (BLOCK_N, BLOCK_K, warps) per M; BLOCK_K = 8 x 32 x warps (dense_gemv_kernel NOTE 1). default_blocks first.
GRID: dict[int, list[tuple[int, int, int]]] = {
    1: [(8, 1024, 4), (4, 1024, 4), (16, 1024, 4), (8, 2048, 8), (16, 512, 2), (4, 2048, 8)],
    2: [(4, 1024, 4), (8, 1024, 4), (2, 1024, 4), (4, 2048, 8)],
    4: [(2, 1024, 4), (4, 1024, 4), (1, 1024, 4), (2, 2048, 8)],
}
PROGRAMS_PER_SM = (8, 4, 16)
WIN = 0.98  # the GEMV takes a shape when it needs <= 98 % of cuBLAS's time (timing noise is ~1 %)


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def read_bandwidth_gbs() -> float:
    """A read-only stream: torch.sum over 2 GiB of bf16 (the GEMV's own traffic pattern, minus the FMAs)."""
    src = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        src.sum(dtype=torch.float32)
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src
    torch.cuda.empty_cache()
    return (1 << 31) / statistics.median(times) / 1e9


def make_weights(n: int, k: int, device: str, dtype: torch.dtype, copies: int) -> list[torch.Tensor]:
    w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
    return [w] + [w.clone() for _ in range(copies - 1)]


def err_of(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def cublas_call(x: torch.Tensor, w: torch.Tensor, gated: bool) -> Callable[[], torch.Tensor]:
    if gated:
        from pagedllm.layers.triton_ops import act_and_mul

        return lambda: F.linear(act_and_mul(x, "silu"), w)
    return lambda: F.linear(x, w)


def point(timer: Timer, ws: list[torch.Tensor], x: torch.Tensor, ref: torch.Tensor, cublas_y: torch.Tensor,
          blocks: tuple[int, int, int, int], gated: bool) -> dict[str, Any]:
    from pagedllm.layers.dense_gemv_kernel import dense_gemv

    rec: dict[str, Any] = {"blocks": list(blocks)}
    def call(w: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: dense_gemv(x, w, None, blocks, gated=gated)

    fns = [call(w) for w in ws]
    try:
        y = fns[0]()
        rec["err"] = err_of(y, ref)
        rec["vs_cublas"] = err_of(y, cublas_y)
        rec["same_bits_twice"] = bool(torch.equal(y, fns[0]()))
        rec["us"] = timer.us_per_call(fns)
    except Exception as exc:  # a config the compiler refuses: recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return rec
    n, k = ws[0].shape
    rec["tb_s"] = (ws[0].nbytes + x.nbytes + x.shape[0] * n * x.element_size()) / rec["us"] / 1e6
    return rec


def sweep(args: argparse.Namespace, t_start: float) -> dict[str, Any]:
    from pagedllm.layers.dense_gemv import default_blocks, split_for

    dry = args.dry_run
    device, dtype = ("cpu", torch.float16) if dry else ("cuda", torch.bfloat16)
    shapes = SHAPES_TINY if dry else SHAPES_8B
    timer = Timer(dry)
    n_sm = sms()
    out: dict[str, Any] = {"cublas_us": {}, "points": [], "skipped": 0}
    torch.manual_seed(0)
    weights: dict[str, list[torch.Tensor]] = {}
    xs: dict[str, dict[int, torch.Tensor]] = {}
    refs: dict[str, dict[int, torch.Tensor]] = {}
    cub: dict[str, dict[int, torch.Tensor]] = {}
    for name, (n, k) in shapes.items():
        weights[name] = make_weights(n, k, device, dtype, 1 if dry else math.ceil(ROTATE_BYTES / (2 * n * k)))
        gated = name in GATED
        xs[name] = {m: torch.randn(m, 2 * k if gated else k, device=device).to(dtype) for m in MS}
        for m in MS:
            x = xs[name][m]
            x_eff = F.silu(x[:, :k]) * x[:, k:] if gated else x  # what the two-launch path feeds cuBLAS
            refs.setdefault(name, {})[m] = x_eff.float() @ weights[name][0].float().T
            cub.setdefault(name, {})[m] = F.linear(x_eff, weights[name][0])
            us = timer.us_per_call([cublas_call(x, w, gated) for w in weights[name]])
            w0 = weights[name][0]
            out["cublas_us"][f"{name}@m{m}"] = {
                "us": us, "tb_s": (w0.nbytes + x.nbytes + m * n * x.element_size()) / us / 1e6,
                "err": err_of(cub[name][m], refs[name][m])}
    out["stage1_s"] = round(time.time() - t_start, 1)
    # Stage 2: pass 0 = default_blocks for every (M, shape); pass 1 = the grid x programs per SM (deduplicated).
    order: list[tuple[int, str, tuple[int, int, int, int]]] = []
    for m in MS:
        for name, (n, k) in shapes.items():
            order.append((m, name, tuple(default_blocks(m, n, k, n_sm))))  # type: ignore[arg-type]
    grid = {m: GRID[m][:1] for m in MS} if dry else GRID
    per_sm = PROGRAMS_PER_SM[:1] if dry else PROGRAMS_PER_SM
    for m in MS:
        for bn, bk, warps in grid[m]:
            for ps in per_sm:
                for name, (n, k) in shapes.items():
                    bk_eff = bk if not dry else 128
                    warps_eff = warps if not dry else 1
                    blocks = (bn, bk_eff, warps_eff, split_for(n, k, bn, bk_eff, ps * n_sm))
                    if (m, name, blocks) not in order:
                        order.append((m, name, blocks))
    for m, name, blocks in order:
        if not dry and time.time() - t_start > BUDGET_S:
            out["skipped"] += 1
            continue
        rec = point(timer, weights[name], xs[name][m], refs[name][m], cub[name][m], blocks, name in GATED)
        rec.update(shape=name, m=m)
        out["points"].append(rec)
    out["stage2_s"] = round(time.time() - t_start, 1)
    del weights, xs, refs, cub
    gc.collect()
    if not dry:
        torch.cuda.empty_cache()
    out["summary"] = summarize(out, shapes)
    return out


def summarize(out: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Per (shape, M): cuBLAS, the fastest GEMV point, the ratio; per M: the layer's four linears summed."""
    best: dict[str, dict[str, Any]] = {}
    for rec in out["points"]:
        if "us" not in rec:
            continue
        key = f"{rec['shape']}@m{rec['m']}"
        if key not in best or rec["us"] < best[key]["us"]:
            best[key] = rec
    rows: dict[str, Any] = {}
    table: dict[str, Any] = {}
    for m in MS:
        for name, (n, k) in shapes.items():
            key = f"{name}@m{m}"
            cb = out["cublas_us"].get(key)
            g = best.get(key)
            if cb is None or g is None:
                continue
            wins = g["us"] <= WIN * cb["us"]
            rows[key] = {"cublas_us": round(cb["us"], 2), "cublas_tb_s": round(cb["tb_s"], 3),
                         "gemv_us": round(g["us"], 2), "gemv_tb_s": round(g["tb_s"], 3), "blocks": g["blocks"],
                         "speedup": round(cb["us"] / g["us"], 3), "gemv_takes_it": wins,
                         "err": g["err"], "vs_cublas": g["vs_cublas"], "same_bits_twice": g["same_bits_twice"]}
            if name not in GATED:  # down_gated shares down's entry (and its switch): reported, not tabled
                table[f"({m}, {n}, {k})"] = g["blocks"] if wins else None
        for layer, names in LAYERS.items():  # the four linears (cuBLAS) against the table's choice per shape
            got = [rows.get(f"{name}@m{m}") for name in names]
            if any(r is None for r in got):
                continue
            cublas = sum(r["cublas_us"] for r in got if r)
            chosen = sum((r["gemv_us"] if r["gemv_takes_it"] else r["cublas_us"]) for r in got if r)
            rows[f"{layer}@m{m}"] = {"cublas_us": round(cublas, 2), "with_gemv_table_us": round(chosen, 2),
                                     "x32_saved_ms": round(32 * (cublas - chosen) / 1e3, 3)}
    return {"rows": rows, "gemv_table": table,
            "nondeterministic": [f"{r['shape']}@m{r['m']} {r['blocks']}" for r in out["points"]
                                 if r.get("same_bits_twice") is False],
            "max_err": max((r["err"] for r in out["points"] if "err" in r), default=None),
            "max_vs_cublas": max((r["vs_cublas"] for r in out["points"] if "vs_cublas" in r), default=None)}


def install_table(summary: dict[str, Any]) -> dict[tuple[int, int, int], Any]:
    """Put the sweep's choices into dense_gemv.GEMV_TABLE (this process only), as the engine will read them."""
    from pagedllm.layers import dense_gemv

    installed: dict[tuple[int, int, int], Any] = {}
    for key, blocks in summary["gemv_table"].items():
        mnk = tuple(int(v) for v in key.strip("()").split(","))
        installed[mnk] = dense_gemv.DenseGemvBlocks(*blocks) if blocks else None  # type: ignore[index]
    dense_gemv.GEMV_TABLE.update(installed)  # type: ignore[arg-type]
    return installed


def engine_w3(args: argparse.Namespace, t_start: float) -> dict[str, Any]:
    """W3 on one engine: the GEMV off, then on (the sweep's table installed), graphs re-captured each time."""
    from bench_suite import make_prompts, single_stream
    from h200_check import LLAMA_8B_CONFIG

    from pagedllm import LLM
    from pagedllm.config import EngineConfig
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.embedding import ParallelLMHead

    os.makedirs(args.model_dir, exist_ok=True)
    with open(os.path.join(args.model_dir, "config.json"), "w") as f:
        json.dump(LLAMA_8B_CONFIG, f)
    cfg = EngineConfig.from_dict({
        "model": args.model_dir, "dtype": "bfloat16", "device": "cuda", "seed": 0,
        "attention": {"backend": "triton"}, "loader": {"name": "dummy"},
        "kv_cache": {"gpu_memory_utilization": 0.9}, "cuda_graph_sizes": [1, 2, 4, 8],
        "scheduler": {"max_num_seqs": 512, "max_num_batched_tokens": 16384},
    })
    reps = 3 if time.time() - t_start < 110 else 1  # decided before the build (a cold Triton cache: ~25 s)
    t0 = time.perf_counter()
    llm = LLM(config=cfg)
    res: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 1)}
    parts = llm.engine.parts
    weight_bytes = sum(p.numel() * p.element_size() for p in parts.model.parameters())
    res["weight_bytes"] = weight_bytes
    prompts = make_prompts()["W3"]
    tokens: dict[str, list[int]] = {}
    # (mode, GEMV on, LM head on the GEMV, SiLU folded into down, start only before this many seconds)
    modes = [("off", False, False, False, 1e9), ("on", True, True, True, 1e9),
             ("on_head_cublas", True, False, True, 150), ("on_silu_unfolded", True, True, False, 162)]
    for mode, gemv, head, fold, before in modes:
        if time.time() - t_start > before:
            continue
        # A/B on one loaded model: flip the switch the dense methods took at construction.
        for module in parts.model.modules():
            method = getattr(module, "quant_method", None)
            if hasattr(method, "dense_gemv"):
                method.dense_gemv = gemv  # type: ignore[union-attr]
            if isinstance(module, ParallelLMHead):
                cast(Any, module.dense_method).dense_gemv = head
            if isinstance(module, SiluAndMul):
                module.fold_into_gemv = fold  # type: ignore[assignment]
        parts.runner.capture_cuda_graphs([1, 2, 4, 8])
        runs = []
        for i in range(reps):
            runs.append(single_stream(llm, [int(x) for x in prompts[i]], 512, f"w3-{mode}-{i}"))
        res[mode] = {"tpot_ms_median": round(statistics.median(r["tpot_ms"] for r in runs), 3),
                     "tpot_ms": [round(r["tpot_ms"], 3) for r in runs]}
        print(f"[W3 gemv {mode}] {json.dumps(res[mode])}", flush=True)
        tokens[mode] = greedy_tokens(llm, [int(x) for x in prompts[5]], 64)
        if mode == "on" and time.time() - t_start < 150:
            res["profile_on"] = profile_steps(llm, [int(x) for x in prompts[4]])
            print(res["profile_on"], flush=True)
    a, b = tokens["off"], tokens["on"]
    res["greedy_matching_prefix"] = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    res["ms_per_token_saved"] = round(res["off"]["tpot_ms_median"] - res["on"]["tpot_ms_median"], 3)
    llm.shutdown()
    return res


def profile_steps(llm: Any, ids: list[int]) -> str:
    """Device kernels of 8 single-request decode steps (GEMV on): where the rest of the step goes."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import SamplingParams

    engine = llm.engine
    engine.add_request("profile", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32, detokenize=False))
    for _ in range(6):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))


def greedy_tokens(llm: Any, ids: list[int], n: int) -> list[int]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)


def print_table(out: dict[str, Any]) -> None:
    if "copy_bandwidth_gbs" in out:
        print(f"copy {out['copy_bandwidth_gbs']} GB/s (read + write), read-only sum {out['read_bandwidth_gbs']} GB/s")
    print(f"{'shape@M':<14}{'cuBLAS us':>10}{'TB/s':>7}{'GEMV us':>9}{'TB/s':>7}{'speedup':>8}  blocks "
          "[BN, BK, warps, split]  err / vs cuBLAS")
    for key, r in out["summary"]["rows"].items():
        if key.startswith("layer"):
            print(f"{key:<14}{r['cublas_us']:>10.1f}{'':>7}{r['with_gemv_table_us']:>9.1f}{'':>7}"
                  f"{r['cublas_us'] / max(r['with_gemv_table_us'], 1e-9):>8.3f}  32 layers save {r['x32_saved_ms']} ms")
            continue
        mark = "" if r["gemv_takes_it"] else "  (cuBLAS kept)"
        print(f"{key:<14}{r['cublas_us']:>10.1f}{r['cublas_tb_s']:>7.2f}{r['gemv_us']:>9.1f}{r['gemv_tb_s']:>7.2f}"
              f"{r['speedup']:>8.3f}  {r['blocks']}  {r['err']:.1e} / {r['vs_cublas']:.1e}{mark}")
    s = out["summary"]
    print(f"max err {s['max_err']}, max vs cuBLAS {s['max_vs_cublas']}, nondeterministic: {s['nondeterministic'] or 'none'}")
    failed = [p for p in out["points"] if "error" in p]
    print(f"points {len(out['points'])}, failed {len(failed)}, skipped for time {out['skipped']}")
    for p in failed[:5]:
        print("  failed:", p["shape"], p["m"], p["blocks"], p["error"][:160])
    print("GEMV_TABLE entries for core/layers/dense_gemv.py ((M, N, K): (BLOCK_N, BLOCK_K, warps, split) or None):")
    for key, blocks in s["gemv_table"].items():
        print(f"    {key}: {'DenseGemvBlocks' + str(tuple(blocks)) if blocks else None},")
    if "w3" in out:
        w = out["w3"]
        extra = "".join(f", {m} {w[m]['tpot_ms_median']}" for m in ("on_head_cublas", "on_silu_unfolded") if m in w)
        print(f"W3 ms/token: GEMV off {w['off']['tpot_ms_median']}, on {w['on']['tpot_ms_median']}{extra}"
              f" (saved {w['ms_per_token_saved']}); greedy tokens equal for {w['greedy_matching_prefix']} of 64; "
              f"limit {out.get('w3_limit_ms')} ms")
    if "w3_error" in out:
        print("W3 stage failed:", out["w3_error"])
    print(f"total {out['total_s']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="JSON path (e.g. $OUT/gemv_sweep.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes, no engine")
    parser.add_argument("--no-engine", action="store_true", help="skip stage 4 (W3 through the engine)")
    parser.add_argument("--model-dir", default="/tmp/llama31_8b_dummy_pagedllm")
    args = parser.parse_args()
    t_start = time.time()
    out: dict[str, Any] = {"device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
                           "torch": torch.__version__}
    if not args.dry_run:
        from bench_suite import copy_bandwidth_gbs

        out["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)
        out["read_bandwidth_gbs"] = round(read_bandwidth_gbs(), 1)
    out.update(sweep(args, t_start))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if not args.dry_run and not args.no_engine:
        out["installed_table"] = {str(k): v for k, v in install_table(out["summary"]).items()}
        try:
            out["w3"] = engine_w3(args, t_start)
            out["w3_limit_ms"] = round(out["w3"]["weight_bytes"] / (out["copy_bandwidth_gbs"] * 1e9) * 1e3, 3)
        except Exception as exc:  # the sweep's table above is still worth having
            import traceback

            traceback.print_exc()
            out["w3_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    out["total_s"] = time.time() - t_start
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print_table(out)


if __name__ == "__main__":
    main()
