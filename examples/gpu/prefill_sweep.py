"""The Triton attention kernels on prefill-heavy batches: a launch-configuration sweep; one H200.

    python examples/gpu/prefill_sweep.py --out $OUT/prefill_sweep.json        # H200, ~80-140 s
    python examples/gpu/prefill_sweep.py --unified-grid --budget 260 --out $OUT/p.json  # + unified full grid
    python examples/gpu/prefill_sweep.py --cases w1wave --out $OUT/w1wave.json  # one case (~40-60 s)
    python examples/gpu/prefill_sweep.py --dry-run --out /tmp/prefill.json    # CPU, Triton interpreter

Two kernels: the unified paged kernel (triton/kernels.py, K/V gathered from the pages; its table entries, the
full grid measured 2026-11-29 with --unified-grid) and the fresh-prefill kernel (triton/prefill.py, K/V read
from the step's own key/value rows through TMA descriptors; rows labelled F, run on the all-fresh cases).

Cases (32 query / 8 KV heads, head 128, page 16, bf16, random non-contiguous blocks):
  8x2048   8 fresh prefills of 2048 tokens, causal          (275 GFLOP: docs/perf-notes.md 1b)
  1x8192   one fresh prefill of 8192 tokens                  (550 GFLOP)
  mixed    4 fresh prefills of 2048 + 256 decodes at a 2048-token context, decodes first as the engine
  w1wave   480 decodes at 1024..1151-token contexts + 16 fresh prompts of 1024 (a W1 mixed step)
           orders them (137.5 + 8.6 GFLOP; the decodes also read 2.1 GB of K/V)
FLOPs = 4 x (visible query-key pairs) x 32 heads x 128: masked-out work is not counted.

Each config of the grid (triton/tuning.py's AttentionConfig / FreshPrefillConfig) runs on every case it
applies to: output checked against torch SDPA in float32 on the same K/V (rel_l2 = ||out - ref|| / ||ref||, ok
below 1e-2; bf16 rounding gives ~2e-3), then timed with CUDA events, median of 20 calls after 3 warm-up
calls. Also timed: the unified rule's default (`default`: unified_attention with no config) and the engine
path (`forward`: TritonImpl.forward with reshape_and_cache, the fresh route as the backend takes it;
`fwd-paged`: the same with the route off), both checked too. Triton compiles run first in parallel worker
processes (they fill Triton's on-disk cache; the timing process then only loads), and configs past a 140 s
budget are skipped, defaults first in the order. The last lines printed are a table per case (best 8 of each
kernel, the v1 best, the defaults); all numbers are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h200_check  # noqa: E402

T0 = time.time()
BUDGET_S = 140.0  # configs not started by then are skipped (the tables say how many)


@dataclass(frozen=True)
class Shape:
    """Model shape and the cases' request lists (contexts cached before the step, new tokens)."""

    heads: int
    kv_heads: int
    head: int
    page: int
    dtype: torch.dtype
    device: str
    cases: dict[str, tuple[list[int], list[int]]]


def gpu_shape() -> Shape:
    return Shape(32, 8, 128, 16, torch.bfloat16, "cuda", {
        "8x2048": ([0] * 8, [2048] * 8),
        "1x8192": ([0], [8192]),
        "mixed": ([2047] * 256 + [0] * 4, [1] * 256 + [2048] * 4),
        # A W1 mixed step (perf-notes §17): ~480 decodes at contexts 1024..1151 beside 16 fresh 1024-token prompts.
        "w1wave": ([1024 + (7 * i) % 128 for i in range(480)] + [0] * 16, [1] * 480 + [1024] * 16),
    })


def dry_shape() -> Shape:
    return Shape(8, 2, 16, 16, torch.float16, "cpu", {
        "8x2048": ([0] * 2, [160] * 2),
        "1x8192": ([0], [300]),
        "mixed": ([39] * 4 + [0] * 2, [1] * 4 + [140] * 2),
        "w1wave": ([20 + 3 * i for i in range(6)] + [0] * 2, [1] * 6 + [100] * 2),
    })


def grid(dry: bool, unified_grid: bool = False) -> list[Any]:
    """Configs in the order they run: the tables' entries and the v1 best first (a budget cut drops the tail),
    then the fresh-prefill grid, then (--unified-grid) the unified kernel's full grid."""
    from pagedllm.plugins.attention.triton import tuning as tt

    v1_best = v1_best_config()
    fresh = tt.FreshPrefillConfig
    if dry:
        return [tt.PREFILL, v1_best, replace(tt.PREFILL, pack_gqa=False), tt.FRESH_PREFILL,
                fresh(rows=16, tile_n=16, num_warps=4, num_stages=2, kv_load="device", warp_specialize=True),
                fresh(rows=16, tile_n=16, num_warps=4, num_stages=2, kv_load="pointer", pack_gqa=False)]
    # the 1 x 8192 best of the last sweep (triton/tuning.py NOTE 4)
    long_best = tt.AttentionConfig(rows=128, tile_n=128, num_warps=8, num_stages=5, reverse=True, k_rows=True)
    out: list[Any] = [tt.PREFILL, tt.MIXED, v1_best, long_best, tt.FRESH_PREFILL]
    # Narrower programs for mixed steps (perf-notes §17e): a decode's 4 rows waste less of 32 or 16 rows than
    # of MIXED's 64, the prompts keep tensor-core tiles; DECODE_WIDE itself as the single launch for contrast.
    cfg = tt.AttentionConfig
    out += [cfg(rows=32, tile_n=64, num_warps=4, num_stages=3, k_rows=True),
            cfg(rows=32, tile_n=32, num_warps=4, num_stages=3, reverse=True, k_rows=True),
            cfg(rows=32, tile_n=64, num_warps=4, num_stages=2, reverse=True, k_rows=True), tt.DECODE_WIDE]
    # Fresh kernel (triton/prefill.py). 128 rows: 4 warps spill the 128 x 128 float32 accumulator unless
    # warp-specialized (then 2 consumer warpgroups of 64 rows + a TMA producer: 12 warps, 168 registers, no
    # spills offline); 128 x 128 tiles at 3 stages take 225 KB of shared memory, 4 would not fit.
    for tile, stages in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3)):
        out.append(fresh(rows=128, tile_n=tile, num_warps=8, num_stages=stages))
    for tile, stages in ((64, 2), (64, 3), (64, 4), (128, 2)):
        out.append(fresh(rows=128, tile_n=tile, num_warps=4, num_stages=stages, kv_load="device",
                         warp_specialize=True))
    out += [fresh(rows=128, tile_n=64, num_warps=8, num_stages=3, pack_gqa=False),
            fresh(rows=128, tile_n=128, num_warps=8, num_stages=2, pack_gqa=False),
            fresh(rows=128, tile_n=64, num_warps=8, num_stages=3, kv_load="device"),
            fresh(rows=128, tile_n=64, num_warps=8, num_stages=3, kv_load="pointer"),
            fresh(rows=128, tile_n=64, num_warps=8, num_stages=5, kv_load="pointer"),
            fresh(rows=64, tile_n=64, num_warps=4, num_stages=3),
            fresh(rows=64, tile_n=64, num_warps=4, num_stages=3, pack_gqa=False)]
    if unified_grid:
        out += unified_full_grid()
    return list(dict.fromkeys(out))  # drop repeats, keep the order


def unified_full_grid() -> list[Any]:
    """The unified kernel's grid of the 2026-11-29 sweep (triton/tuning.py NOTE 4)."""
    from pagedllm.plugins.attention.triton import tuning as tt

    cfg = tt.AttentionConfig
    v1_best = v1_best_config()
    out: list[Any] = []
    # 1. rows x tile x warps x stages, the layout switches at the PREFILL entry's (reverse, K as rows).
    #    Stages 2, 3 and 4 all prefetch one K/V tile (triton/tuning.py NOTE 1): 4 only once, as evidence.
    sw = {"reverse": tt.PREFILL.reverse, "k_rows": tt.PREFILL.k_rows}
    for tile in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 5):
                out.append(cfg(rows=64, tile_n=tile, num_warps=warps, num_stages=stages, **sw))
    for tile, stages in ((32, 2), (32, 3), (32, 5), (32, 7), (64, 2), (64, 3), (64, 4), (64, 5), (64, 7),
                         (128, 2), (128, 3), (128, 5)):  # 128 x 128 at 5 stages: 225 KB of 227 (sm_90)
        out.append(cfg(rows=128, tile_n=tile, num_warps=8, num_stages=stages, **sw))
    out.append(cfg(rows=128, tile_n=64, num_warps=4, num_stages=3, **sw))  # 4 warps: the accumulator spills
    # 2. each switch off / on at the PREFILL entry, and one head per program (PACK_GQA off).
    p = tt.PREFILL
    out += [replace(p, reverse=not p.reverse), replace(p, k_rows=not p.k_rows),
            replace(p, reverse=False, k_rows=False), replace(p, pack_gqa=False),
            replace(p, pack_gqa=False, rows=64, num_warps=4), replace(v1_best, reverse=True),
            replace(v1_best, k_rows=True)]
    return out


def is_fresh(config: Any) -> bool:
    from pagedllm.plugins.attention.triton.tuning import FreshPrefillConfig

    return isinstance(config, FreshPrefillConfig)


def applies(config: Any, case: dict[str, Any]) -> bool:
    """The fresh kernel runs only on cases whose every request is a fresh prefill."""
    return not is_fresh(config) or not any(case["contexts"])


def v1_best_config() -> Any:
    """The best of the v1 sweep (docs/perf-notes.md 1b: 319 TFLOP/s on 8x2048), without the new switches."""
    from pagedllm.plugins.attention.triton.tuning import AttentionConfig

    return AttentionConfig(rows=64, tile_n=64, num_warps=4, num_stages=2)


def flops(contexts: list[int], queries: list[int], heads: int, head: int) -> float:
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in zip(contexts, queries))
    return 4.0 * pairs * heads * head


def build_case(shape: Shape, contexts: list[int], queries: list[int], seed: int) -> dict[str, Any]:
    """Random paged cache and queries, the step's common metadata, and each request's block ids."""
    from pagedllm.worker.input_prep import prepare_inputs

    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(c + q) // shape.page) for c, q in zip(contexts, queries)]
    num_blocks = sum(needs) + 1  # block 0: the null block
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_ids, used = [], 0
    for n in needs:
        block_ids.append(perm[used:used + n])
        used += n
    num_decodes = sum(1 for q in queries if q == 1)
    dev = torch.device(shape.device)
    inputs = prepare_inputs([[0] * (c + q) for c, q in zip(contexts, queries)], contexts, queries, block_ids,
                            shape.page, dev, num_decodes)
    tokens = sum(queries)
    dgen = torch.Generator(device=dev).manual_seed(seed)
    # drawn in the cache dtype: no float32 copy (the mixed case's cache is 2.1 GB in bf16, in every worker)
    cache = torch.randn(2, num_blocks, shape.page, shape.kv_heads, shape.head, generator=dgen, device=dev,
                        dtype=shape.dtype)
    # q, k, v as the model hands them over: views of one fused projection row; k and v are the new tokens'
    # entries of the cache (their slots), so both kernels see the same keys and reshape_and_cache rewrites them.
    slots = inputs.attn.slot_mapping
    new_kv = [cache[i].view(-1, shape.kv_heads, shape.head)[slots].flatten(1) for i in (0, 1)]
    qkv = torch.cat([torch.randn(tokens, shape.heads * shape.head, generator=dgen, device=dev, dtype=shape.dtype),
                     *new_kv], dim=1)
    q, k, v = qkv.split([shape.heads * shape.head, shape.kv_heads * shape.head, shape.kv_heads * shape.head], 1)
    return {"common": inputs.attn, "cache": cache, "q": q.view(tokens, shape.heads, shape.head),
            "k": k.view(tokens, shape.kv_heads, shape.head), "v": v.view(tokens, shape.kv_heads, shape.head),
            "block_ids": block_ids, "contexts": contexts, "queries": queries, "plans": {},
            "out": torch.empty(tokens, shape.heads, shape.head, dtype=shape.dtype, device=dev)}


def reference(shape: Shape, case: dict[str, Any]) -> torch.Tensor:
    """torch SDPA in float32 on each request's K/V gathered from the cache (fresh prefills and decodes only)."""
    q_all, cache = case["q"].float(), case["cache"]
    group = shape.heads // shape.kv_heads
    out = torch.empty_like(q_all)
    start = 0
    decodes: list[tuple[int, list[int], int]] = []
    for ctx, qn, blocks in zip(case["contexts"], case["queries"], case["block_ids"]):
        seq = ctx + qn
        if qn == 1:  # batched below: one SDPA call for every decode of the same length
            decodes.append((start, blocks, seq))
            start += 1
            continue
        assert ctx == 0, "SDPA's is_causal aligns top-left: only fresh prefills (or decodes) are checked"
        k, v = (cache[i, blocks].flatten(0, 1)[:seq].float() for i in (0, 1))  # [seq, kv, d]
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1)[None] for x in (k, v))
        qr = q_all[start:start + qn].transpose(0, 1)[None]
        out[start:start + qn] = F.scaled_dot_product_attention(qr, k, v, is_causal=True)[0].transpose(0, 1)
        start += qn
    for seq in sorted({s for _, _, s in decodes}):  # one SDPA call per context length
        same = [(r, b) for r, b, s in decodes if s == seq]
        rows = torch.tensor([r for r, _ in same], device=q_all.device)
        width = max(len(b) for _, b in same)
        blk = torch.tensor([b + [0] * (width - len(b)) for _, b in same], device=q_all.device)  # [D, blocks]
        k, v = (cache[i][blk].flatten(1, 2)[:, :seq].float().transpose(1, 2) for i in (0, 1))  # [D, kv, seq, d]
        # One query token, no mask: a KV head's G query heads are just G query rows against its keys.
        qd = q_all[rows].view(len(same), shape.kv_heads, group, shape.head)
        out[rows] = F.scaled_dot_product_attention(qd, k, v).flatten(1, 2)
    return out


def call(shape: Shape, case: dict[str, Any], config: Any) -> None:
    from pagedllm.plugins.attention.triton.kernels import unified_attention

    c = case["common"]
    if is_fresh(config):
        from pagedllm.plugins.attention.triton.prefill import (
            fresh_prefill_attention,
            launch_shape,
            plan_blocks,
        )

        block_q = launch_shape(config, shape.heads // shape.kv_heads)[1]
        plan = case["plans"].get(block_q)
        if plan is None:  # once per case (the backend builds it once per step)
            plan = case["plans"][block_q] = torch.from_numpy(
                plan_blocks(c.query_start_loc_cpu.numpy(), block_q)).to(case["q"].device)
        fresh_prefill_attention(case["q"], case["k"], case["v"], case["out"], plan, c.num_actual_tokens,
                                shape.head**-0.5, config=config)
        return
    unified_attention(case["q"], case["cache"], case["out"], c.query_start_loc, c.seq_lens, c.block_table,
                      c.num_reqs, c.num_actual_tokens, shape.head**-0.5, config=config)


def time_ms(fn: Any, dry: bool, iters: int = 20, warmup: int = 3) -> float:
    """h200_check.time_ms (median of CUDA-event pairs); a dry run times one call on the CPU."""
    if dry:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return float(h200_check.time_ms(fn, iters=iters, warmup=warmup))


def _precompile(unified_grid: bool, indices: list[int], names: list[str]) -> None:
    """Worker: run each of its configs once on every case named, so Triton's on-disk cache holds the binaries."""
    shape, configs = gpu_shape(), grid(False, unified_grid)
    cases = [build_case(shape, ctx, qs, seed) for seed, (name, (ctx, qs)) in enumerate(shape.cases.items())
             if name in names]
    for i in indices:
        for case in cases:
            if not applies(configs[i], case):
                continue
            try:
                call(shape, case, configs[i])
            except Exception:  # noqa: BLE001 - the timing process records the error
                break
    torch.cuda.synchronize()


def precompile(n_configs: int, unified_grid: bool, names: list[str]) -> float:
    t = time.time()
    workers = max(1, min(12, (os.cpu_count() or 2) - 2, n_configs))
    chunks = [list(range(i, n_configs, workers)) for i in range(workers)]
    try:
        with mp.get_context("spawn").Pool(workers) as pool:
            pool.starmap_async(_precompile, [(unified_grid, c, names) for c in chunks]).get(timeout=110)
    except Exception as exc:  # noqa: BLE001 - the timing process then compiles what is missing itself
        print(f"precompile failed ({type(exc).__name__}: {exc}); compiling in the timing process", flush=True)
    return time.time() - t


def forward_row(shape: Shape, case: dict[str, Any], ref: torch.Tensor, work: float, dry: bool,
                route: str) -> dict[str, Any]:
    """TritonImpl.forward as the engine calls it (reshape_and_cache of the step's K/V, then the kernels), the
    fresh route as build_metadata decides (`route` "rule"), switched off ("off"), taken by any fresh run
    ("any": as with plugins.triton.fresh_prefill_min_tokens at its floor), or the decodes split into their own
    launch ("split", plugins.triton.split_decodes_min); checked, then timed."""
    from pagedllm.plugins.attention.triton.backend import TritonBackend, fresh_run_start
    from pagedllm.protocols.attention import AttentionLayerConfig

    layer = AttentionLayerConfig(shape.heads, shape.head, shape.kv_heads, shape.head**-0.5)
    impl, md = TritonBackend.make_impl(layer), TritonBackend.build_metadata(case["common"])
    if route == "off":
        md.fresh_from = None
    elif route == "any":
        md.fresh_from = fresh_run_start(case["common"], 0)
    elif route == "split":  # triton/backend.py NOTE 5: the decodes as their own launch, fresh route off
        md.fresh_from = None
        md.split_decodes = case["common"].num_decodes or None
    # forward rewrites the step's K/V at their slots: the same values (build_case), so the cache stays as checked
    def run() -> torch.Tensor:
        return impl.forward(case["q"], case["k"], case["v"], case["cache"], md)

    try:
        out = run()
        rel = float((out.float() - ref).norm() / ref.norm())
        ms = time_ms(run, dry)
        return {"ms": round(ms, 4), "TFLOPs": round(work / ms / 1e9, 1), "rel_l2": rel,
                "ok": bool(rel < 1e-2 and not torch.isnan(out).any()),
                "fresh_from": md.fresh_from, "num_reqs": case["common"].num_reqs}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


# The engine-path rows: key, fresh route (forward_row), label in the tables.
FORWARD_ROWS = (("forward", "rule", "(TritonImpl.forward)"), ("fwd-paged", "off", "(forward, fresh off)"),
                ("fwd-fresh", "any", "(forward, fresh any)"), ("fwd-split", "split", "(forward, decodes apart)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="prefill_sweep.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--no-precompile", action="store_true", help="compile in the timing process (slower)")
    ap.add_argument("--unified-grid", action="store_true", help="also the unified kernel's full grid (+~60 s)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds after which configs are skipped")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    args = ap.parse_args()
    dry = args.dry_run
    shape = dry_shape() if dry else gpu_shape()
    if args.cases:
        shape = replace(shape, cases={k: v for k, v in shape.cases.items() if k in args.cases.split(",")})
    configs = grid(dry, args.unified_grid)
    results: dict[str, Any] = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(),
                               "torch": torch.__version__, "configs": [asdict(c) for c in configs], "cases": {}}
    import triton

    from pagedllm.plugins.attention.triton import tuning as tt

    results["triton"] = triton.__version__
    results["table"] = {"PREFILL": asdict(tt.PREFILL), "MIXED": asdict(tt.MIXED), "DECODE": asdict(tt.DECODE),
                        "PREFILL_MIN_TOKENS_PER_REQ": tt.PREFILL_MIN_TOKENS_PER_REQ,
                        "FRESH_PREFILL": asdict(tt.FRESH_PREFILL), "FRESH_MIN_QUERY_LEN": tt.FRESH_MIN_QUERY_LEN}
    if not dry and not args.no_precompile:
        results["precompile_s"] = round(precompile(len(configs), args.unified_grid, list(shape.cases)), 1)
        print(f"[{time.time() - T0:6.1f}s] precompiled {len(configs)} configs", flush=True)

    cases = {name: build_case(shape, ctx, qs, seed) for seed, (name, (ctx, qs)) in enumerate(shape.cases.items())}
    refs = {name: reference(shape, case) for name, case in cases.items()}
    work = {name: flops(case["contexts"], case["queries"], shape.heads, shape.head) for name, case in cases.items()}
    for name in cases:
        results["cases"][name] = {"gflop": round(work[name] / 1e9, 1), "rows": []}

    def measure(name: str, config: Any) -> dict[str, Any]:
        case = cases[name]
        row: dict[str, Any] = {"config": asdict(config) if config is not None else "default",
                               "kernel": "fresh" if is_fresh(config) else "unified"}
        try:
            call(shape, case, config)  # compile / load, then check
            diff = case["out"].float() - refs[name]
            row["rel_l2"] = float(diff.norm() / refs[name].norm())
            row["max_abs"] = float(diff.abs().max())
            row["ok"] = bool(row["rel_l2"] < 1e-2 and not torch.isnan(case["out"]).any())
            ms = time_ms(lambda: call(shape, case, config), dry)
            row["ms"] = round(ms, 4)
            row["TFLOPs"] = round(work[name] / (ms * 1e-3) / 1e12, 1)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a data point
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return row

    for name in cases:  # the rule's default and the engine path first: always measured
        results["cases"][name]["default"] = measure(name, None)
        for key, route, _ in FORWARD_ROWS:
            results["cases"][name][key] = forward_row(shape, cases[name], refs[name], work[name], dry, route)
    skipped = 0
    for config in configs:
        if not dry and time.time() - T0 > args.budget:
            skipped += 1
            continue
        for name in cases:
            if applies(config, cases[name]):
                results["cases"][name]["rows"].append(measure(name, config))
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    results["skipped_configs"] = skipped
    results["elapsed_s"] = round(time.time() - T0, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print_tables(results)


def _label(c: dict[str, Any]) -> str:
    if "kv_load" in c:  # fresh kernel: F, then h/d/p = host / device descriptors / pointers, W warp-specialized
        flags = c["kv_load"][0] + ("W" if c["warp_specialize"] else "") + ("" if c["pack_gqa"] else "H")
        return f"F m{c['rows']} t{c['tile_n']} w{c['num_warps']} s{c['num_stages']} {flags}"
    flags = "".join(f for f, on in (("R", c["reverse"]), ("K", c["k_rows"]), ("H", not c["pack_gqa"])) if on)
    return f"m{c['rows']} t{c['tile_n']} w{c['num_warps']} s{c['num_stages']} {flags or '-'}"


def print_tables(results: dict[str, Any]) -> None:
    """Per case: the best 8 configs of each kernel, the v1 best, the defaults and the engine path (R reverse,
    K k_rows, H per head; fresh rows: F ... h/d/p descriptors on the host / device or pointers, W warp spec)."""
    v1 = asdict(v1_best_config())
    fresh_default = results["table"]["FRESH_PREFILL"]
    for name, res in results["cases"].items():
        print(f"\n== {name} ({res['gflop']} GFLOP)  {'config':<24} {'TFLOP/s':>8} {'ms':>8} {'rel_l2':>8}  ok")
        rows = [r for r in res["rows"] if "ms" in r]
        marked = []
        for kernel in ("unified", "fresh"):
            mine = [r for r in rows if r.get("kernel") == kernel]
            marked += [("best", r) for r in sorted(mine, key=lambda r: -r["TFLOPs"])[:8]]
        marked += [("v1 best", r) for r in rows if r["config"] == v1]
        marked += [("F dflt", r) for r in rows if r["config"] == fresh_default]
        for tag, r in marked:
            print(f"   {tag:<8} {_label(r['config']):<24} {r['TFLOPs']:>8} {r['ms']:>8} {r['rel_l2']:>8.1e}  {r['ok']}")
        d = res["default"]
        if "ms" in d:
            print(f"   {'default':<8} {'(unified rule)':<24} {d['TFLOPs']:>8} {d['ms']:>8} {d['rel_l2']:>8.1e}  {d['ok']}")
        for key, _, what in FORWARD_ROWS:
            f = res[key]
            if "ms" in f:
                routed = "paged only" if f["fresh_from"] is None else \
                    f"fresh from request {f['fresh_from']} of {f['num_reqs']}"
                print(f"   {key:<8} {what:<24} {f['TFLOPs']:>8} {f['ms']:>8} {f['rel_l2']:>8.1e}  {f['ok']}  {routed}")
            else:
                print(f"   {key:<8} {what:<24} {f.get('error')}")
        bad = [r for r in res["rows"] if "error" in r or not r.get("ok")]
        if bad:
            print(f"   {len(bad)} config(s) failed or off: " + "; ".join(
                f"{_label(r['config'])}: {r.get('error', r.get('rel_l2'))}"[:120] for r in bad[:4]))
    print(f"\nelapsed {results['elapsed_s']} s, skipped {results['skipped_configs']} configs "
          f"(precompile {results.get('precompile_s', '-')} s)")


if __name__ == "__main__":
    main()
