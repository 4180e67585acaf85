"""The fused-MoE Triton kernel vs a per-expert torch loop vs vLLM's fused MoE, on dummy weights, on the GPU.

    python examples/gpu/bench_fused_moe.py [--shapes mixtral,gpt-oss-20b] [--tokens 1,16,64,256,1024,4096]
                                           [--tp 1] [--dtype bfloat16] [--vllm] [--json OUT]
    python examples/gpu/bench_fused_moe.py --dry-run      # CPU, tiny shapes: the loop and the reference only
                                                          # (+ our kernel when TRITON_INTERPRET=1)

Shapes (I is divided by --tp, as one tensor-parallel rank holds it):
  mixtral      E=8,  K=2, H=4096, I=14336, silu, no biases (Mixtral-8x7B)
  gpt-oss-20b  E=32, K=4, H=2880, I=2880,  swigluoai (alpha 1.702, limit 7) with both biases
Routing: random router logits, softmax over the top k (distinct experts per token), the same for every
implementation. Implementations:
  ours    pagedllm.layers.fused_moe_triton.fused_moe (tile table of moe_kernel_config.py)
  loop    pagedllm.layers.moe_reference.fused_moe_reference: per expert, gather its rows, two matmuls, scatter
          (one host read of the per-expert counts per call) -- the torch code a model would run without a kernel
  vllm    (--vllm) fused_experts of vllm.model_executor.layers.fused_moe.fused_moe (vLLM 0.20.0 the target). Its
          swigluoai reads gate/up interleaved, so it gets the same weights with the rows interleaved, and its
          biases through biased_moe_quant_config; whatever this vLLM lacks is reported as n/a, not hidden.
Timing: `eager` is one call between CUDA events after warm-up (median; launch overhead included: what an eager
prefill step pays); `graph` is 10 calls captured in one CUDA graph and replayed (median per call: what a
decode step inside a CUDA graph pays). The loop reads counts back to the host, so it has no graph time.
Checked: max |x - loop| / max |loop| for ours and for vLLM, per row (bf16: expect ~1e-2 or below).
Tuning: --config '{"block_m": 16, "block_n": 64, "block_k": 128, "down_block_n": 32}' runs ours with that
MoeKernelConfig for every row; --sweep also times every config of SWEEP per row (graph time on the GPU) and
prints the fastest, to check against moe_kernel_config (its rule and DEFAULT_TABLE, NOTE 2 there).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str
    bias: bool


SHAPES = {
    "mixtral": Shape("mixtral", 8, 2, 4096, 14336, "silu", False),
    "gpt-oss-20b": Shape("gpt-oss-20b", 32, 4, 2880, 2880, "swigluoai", True),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 128, 8, 2048, 768, "silu", False),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", 64, 6, 2048, 1408, "silu", False),
    # Shapes the tile rule was not derived from (moe_kernel_config NOTE 2), to check it on.
    "phi-3.5-moe": Shape("phi-3.5-moe", 16, 2, 4096, 6400, "silu", False),
    "qwen2-57b-a14b": Shape("qwen2-57b-a14b", 64, 8, 3584, 2560, "silu", False),
}
DRY_SHAPES = {  # the same routing shapes with tiny matrices, for the CPU
    "mixtral": Shape("mixtral", 8, 2, 64, 48, "silu", False),
    "gpt-oss-20b": Shape("gpt-oss-20b", 32, 4, 48, 40, "swigluoai", True),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 128, 8, 32, 24, "silu", False),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", 64, 6, 32, 24, "silu", False),
    "phi-3.5-moe": Shape("phi-3.5-moe", 16, 2, 32, 24, "silu", False),
    "qwen2-57b-a14b": Shape("qwen2-57b-a14b", 64, 8, 32, 24, "silu", False),
}
GRAPH_CALLS = 10
# --sweep candidates: (block_m, block_n, block_k, group_m, num_warps, num_stages, down_block_n)
SWEEP = (
    (16, 128, 128, 16, 4, 4, None), (16, 128, 128, 16, 4, 4, 64), (16, 64, 256, 16, 4, 3, 32),
    (16, 256, 64, 1, 4, 4, 64), (32, 128, 128, 16, 4, 3, None), (32, 128, 64, 8, 4, 4, 64),
    (64, 128, 128, 8, 8, 3, None), (64, 256, 64, 8, 8, 3, 128), (128, 256, 64, 16, 8, 3, None),
    (128, 128, 64, 8, 4, 4, None),
)


@dataclass
class Problem:
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    weights: torch.Tensor
    ids: torch.Tensor
    activation: str

    def args(self) -> tuple[Any, ...]:
        return (self.hidden, self.w13, self.w2, self.weights, self.ids, self.activation, self.b13, self.b2)


def make_problem(shape: Shape, tokens: int, tp: int, dtype: torch.dtype, device: str, seed: int = 0) -> Problem:
    gen = torch.Generator(device=device).manual_seed(seed)
    inter = shape.inter // tp
    e, h = shape.experts, shape.hidden

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*size, generator=gen, device=device)).to(dtype)

    logits = torch.randn(tokens, e, generator=gen, device=device)
    values, ids = torch.topk(logits, shape.top_k, dim=-1)
    return Problem(
        hidden=randn(tokens, h), w13=randn(e, 2 * inter, h, scale=h ** -0.5), w2=randn(e, h, inter, scale=inter ** -0.5),
        b13=randn(e, 2 * inter, scale=0.1) if shape.bias else None, b2=randn(e, h, scale=0.1) if shape.bias else None,
        weights=torch.softmax(values, dim=-1).float(), ids=ids.to(torch.int32), activation=shape.activation,
    )


def vllm_op(p: Problem) -> Callable[[], torch.Tensor]:
    """vLLM's fused_experts on p (raises with the reason where this vLLM cannot run it)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    activation: Any = p.activation
    try:  # newer vLLMs take the activation as an enum (fused_moe/activation.py), older ones as its string
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        activation = MoEActivation.from_str(p.activation)
    except ImportError:
        pass
    kwargs: dict[str, Any] = {"inplace": False, "activation": activation}
    w13, b13 = p.w13, p.b13
    if p.activation == "swigluoai":  # vLLM's swigluoai_and_mul reads gate, up interleaved: rows g0 u0 g1 u1 ...
        e, two_i, h = w13.shape
        w13 = torch.stack(w13.split(two_i // 2, dim=1), dim=2).reshape(e, two_i, h).contiguous()
        if b13 is not None:
            b13 = torch.stack(b13.split(two_i // 2, dim=1), dim=2).reshape(e, two_i).contiguous()
    if b13 is not None or p.b2 is not None:
        from vllm.model_executor.layers.fused_moe.config import biased_moe_quant_config

        kwargs["quant_config"] = biased_moe_quant_config(b13, p.b2)
    enter: Callable[[], Any] | None = None
    try:  # newer vLLMs read their config from a context even for a bare kernel call
        from vllm.config import VllmConfig, set_current_vllm_config

        config = VllmConfig()
        enter = functools.partial(set_current_vllm_config, config)
    except Exception as exc:  # noqa: BLE001 - then the call runs without one (and says so if it needs it)
        print(f"    vllm: running without a VllmConfig context ({type(exc).__name__}: {exc})"[:200])

    def run() -> torch.Tensor:
        if enter is None:
            return fused_experts(p.hidden, w13, p.w2, p.weights, p.ids, **kwargs)
        with enter():
            return fused_experts(p.hidden, w13, p.w2, p.weights, p.ids, **kwargs)

    return run


def eager_us(fn: Callable[[], Any], iters: int, device: str) -> float:
    """Median microseconds of one call (CUDA events on the GPU, perf_counter on the CPU), after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graph_us(fn: Callable[[], Any], iters: int) -> float:
    """Median device microseconds per call of fn from a CUDA graph of GRAPH_CALLS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(3, iters // 4)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    del graph
    return statistics.median(times)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def measure(name: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None, iters: int, device: str,
            graph: bool) -> dict[str, Any]:
    """{eager_us, graph_us, err} for one implementation; {'error': why} where it cannot run."""
    try:
        out = fn()
        row: dict[str, Any] = {"err": rel_err(out, ref) if ref is not None else 0.0}
        row["eager_us"] = eager_us(fn, iters, device)
        if graph:
            try:
                row["graph_us"] = graph_us(fn, iters)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                row["graph_us"] = None
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    except Exception as exc:  # noqa: BLE001 - one implementation failing must not hide the others
        return {"error": f"{name}: {type(exc).__name__}: {exc}"[:300]}


def sweep(p: Problem, ref: torch.Tensor, iters: int, device: str) -> dict[str, Any]:
    """Ours under every SWEEP config: the fastest (graph time on the GPU, eager on the CPU) and all times."""
    from pagedllm.layers.fused_moe_triton import fused_moe
    from pagedllm.layers.moe_kernel_config import MoeKernelConfig, override_config

    timed: list[dict[str, Any]] = []
    for values in SWEEP:
        cfg = MoeKernelConfig(*values)

        def run(cfg: MoeKernelConfig = cfg) -> torch.Tensor:
            with override_config(cfg):
                return fused_moe(*p.args())

        res = measure(f"ours {values}", run, ref, iters, device, device == "cuda")
        us = res.get("graph_us") or res.get("eager_us")
        timed.append({"config": dataclasses.asdict(cfg), "us": us, "err": res.get("err"), "error": res.get("error")})
    ok = [t for t in timed if t["us"] is not None]
    return {"best": min(ok, key=lambda t: float(t["us"])) if ok else None, "all": timed}


def run_rows(shapes: list[Shape], tokens: list[int], tp: int, dtype: torch.dtype, device: str, iters: int,
             with_vllm: bool, with_ours: bool, config: Any = None, do_sweep: bool = False) -> list[dict[str, Any]]:
    """One row per (shape, tokens): each implementation's times and error (see the module doc)."""
    from pagedllm.layers.moe_kernel_config import override_config
    from pagedllm.layers.moe_reference import fused_moe_reference

    ours: Callable[..., torch.Tensor] | None = None
    if with_ours:
        from pagedllm.layers.fused_moe_triton import fused_moe

        ours = fused_moe
    rows = []
    for shape in shapes:
        for t in tokens:
            p = make_problem(shape, t, tp, dtype, device)
            ref = fused_moe_reference(*p.args())
            row: dict[str, Any] = {"shape": shape.name, "tokens": t, "experts": shape.experts, "top_k": shape.top_k,
                                   "hidden": shape.hidden, "inter": shape.inter // tp}
            row["loop"] = measure("loop", functools.partial(fused_moe_reference, *p.args()), None, iters, device,
                                  False)
            if ours is not None:
                op = functools.partial(ours, *p.args())
                if config is not None:
                    row["config"] = dataclasses.asdict(config)
                    with override_config(config):
                        row["ours"] = measure("ours", op, ref, iters, device, device == "cuda")
                else:
                    row["ours"] = measure("ours", op, ref, iters, device, device == "cuda")
                if do_sweep:
                    row["sweep"] = sweep(p, ref, iters, device)
            if with_vllm:
                try:
                    vfn = vllm_op(p)
                    row["vllm"] = measure("vllm", vfn, ref, iters, device, device == "cuda")
                except Exception as exc:  # noqa: BLE001 - an import or API mismatch is a reason, not a crash
                    row["vllm"] = {"error": f"vllm: {type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(format_row(row), flush=True)
            if row.get("sweep", {}).get("best"):
                best = row["sweep"]["best"]
                print(f"    sweep best {best['us']:.1f} us (err {best['err']:.1e}): {best['config']}", flush=True)
            del p, ref
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


HEADER = (f"{'shape':<12}{'T':>6} | {'ours eager':>10}{'graph':>9} | {'loop':>9} | {'vllm eager':>10}{'graph':>9} "
          f"| {'loop/ours':>9}{'vllm/ours':>10}{'(graph)':>9} | {'err ours':>9}{'err vllm':>9}")


def format_row(row: dict[str, Any]) -> str:
    def get(impl: str, key: str) -> float | None:
        value = row.get(impl, {}).get(key)
        return float(value) if isinstance(value, (int, float)) else None

    def us(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else "n/a"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    def err(v: float | None) -> str:
        return f"{v:.1e}" if v is not None else "n/a"

    ours_e, ours_g = get("ours", "eager_us"), get("ours", "graph_us")
    vllm_e, vllm_g = get("vllm", "eager_us"), get("vllm", "graph_us")
    loop_e = get("loop", "eager_us")
    line = (f"{row['shape']:<12}{row['tokens']:>6} | {us(ours_e):>10}{us(ours_g):>9} | {us(loop_e):>9} | "
            f"{us(vllm_e):>10}{us(vllm_g):>9} | {ratio(loop_e, ours_e):>9}{ratio(vllm_e, ours_e):>10}"
            f"{ratio(vllm_g, ours_g):>9} | {err(get('ours', 'err')):>9}{err(get('vllm', 'err')):>9}")
    notes = [row[k]["error"] for k in ("ours", "loop", "vllm") if isinstance(row.get(k), dict) and "error" in row[k]]
    return line + "".join(f"\n    {n}" for n in notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral,gpt-oss-20b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: I is divided by it")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's fused_experts (import guarded)")
    ap.add_argument("--json", help="write every row (timings, errors, reasons) to this file")
    ap.add_argument("--config", help="JSON of MoeKernelConfig fields: run ours with it for every row")
    ap.add_argument("--sweep", action="store_true", help="also time ours under every SWEEP config per row")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes, tokens 1,16,64: the loop (+ our kernel under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)

    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    config = None
    if args.config:
        from pagedllm.layers.moe_kernel_config import MoeKernelConfig

        try:
            config = MoeKernelConfig(**json.loads(args.config))
        except (ValueError, TypeError) as exc:
            ap.error(f"--config: {exc}")
    if args.dry_run:
        device, dtype = "cpu", torch.float32
        shapes = [DRY_SHAPES[n] for n in names]
        tokens = [t for t in tokens if t <= 64] or [1]
        with_ours = os.environ.get("TRITON_INTERPRET") == "1"
        if not with_ours:
            print("dry run: our kernel needs CUDA or TRITON_INTERPRET=1; timing the loop only")
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (use --dry-run on the CPU)")
        device, dtype = "cuda", getattr(torch, args.dtype)
        shapes = [SHAPES[n] for n in names]
        with_ours = True
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, tp={args.tp}")
        if args.vllm:
            try:
                import vllm

                print(f"vllm {vllm.__version__}")
            except ImportError as exc:
                print(f"vllm: not importable ({exc}); its columns are n/a")
    print(HEADER)
    rows = run_rows(shapes, tokens, args.tp, dtype, device, args.iters, args.vllm and not args.dry_run, with_ours,
                    config, args.sweep and with_ours)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "dtype": str(dtype), "tp": args.tp, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
