"""Issue 5's workload suite W1–W5 on one GPU, in one process, the way ../shared/anchors/vllm/bench_vllm.py
measures vLLM 0.20.0 (same model shape, same prompts from the same seeds, same warm-up, same timing):

    python examples/gpu/bench_suite.py --out $OUT/pagedllm_suite.json [--workloads W1,W2,W3,W4,W5]
        [--vllm $OUT/vllm_result.json] [--scale 0.25] [--backend triton]

Llama-3.1-8B shape (or `--shape NAME` from model_shapes.py, the table the anchor reads too), bf16, dummy
weights, random token ids in [1000, 120000) (below min(120000, vocab - 100) for a smaller vocabulary), greedy,
ignore_eos.
  W1 1000 x (1024 in, 128 out)     W2 500 x (128 in, 1024 out)     W3 1 x (128 in, 512 out), ms/token
  W4 1000 x (shared 1024-token prefix + 128 unique in, 128 out)   W5 1000 x (in, out uniform in [100, 1024])
Throughput = (input + output tokens) / wall time of one `generate` over all requests. W3 steps the engine by
hand and stamps each token's arrival: (last - first) / (n - 1), median of 3 (vLLM's method).
With `--vllm` (the JSON bench_vllm.py wrote in the same hour) the table shows the ratios side by side.
The W3 hardware limit is printed beside it: weight bytes / measured device copy bandwidth (the bytes counted on
the built model, so they follow the shape; the table also gives the bytes one decode step reads, which leave out
an untied input embedding: a step looks up one row of it).

Another shape writes its own folder and result (`--shape qwen2.5-7b`: /tmp/qwen2.5-7b_dummy_pagedllm,
pagedllm_suite_qwen2.5-7b.json) and refuses a `--vllm` JSON of a different shape. Without a GPU, `--dry-run`
writes the config and draws the prompts, and `--cpu-check LAYERS` builds the shape with its layer count cut
to LAYERS on the CPU (hidden sizes and vocabulary untouched, dummy weights) and generates 2 tokens.

Quantized weights (issue 7), still dummy: `--quantization gptq | awq | gguf-q4_0` (or another GGUF type:
gguf-q8_0, gguf-q4_k, ...) writes a checkpoint-style quantization_config into the config folder, so the dummy
loader fills the method's own packed tensors on the GPU (random codes, small scales, midpoint zeros; no bf16
weight is made first); `fp8` stays the on-the-fly W8A8 of the bf16 weights. `--compare-bf16 W3` (or W2,W3)
first runs the bf16 model on those workloads in the same process (its own engine, shut down before the
quantized one is built) and prints the ratios:

    python examples/gpu/bench_suite.py --quantization gptq --workloads W2,W3 --scale 0.25 --compare-bf16 W2,W3 \
        --out $OUT/w4_gptq.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from model_shapes import (  # noqa: E402
    CHECKPOINT_QUANTIZATION,
    DEFAULT_SHAPE,
    ID_LOW,
    SHAPES,
    default_model_dir,
    id_high,
    result_suffix,
    shape_config,
)


def checkpoint_quantization(name: str | None) -> dict[str, Any] | None:
    """The config.json quantization_config for `--quantization name`; None: none, or an on-the-fly method."""
    if name is None:
        return None
    if name in CHECKPOINT_QUANTIZATION:
        return dict(CHECKPOINT_QUANTIZATION[name])
    if name.startswith("gguf-"):  # random blocks of that type (plugins/quantization/gguf_blocks.random_blocks)
        return {"quant_method": "gguf", "dummy_type": name.removeprefix("gguf-").upper()}
    return None


def make_prompts(high: int) -> dict[str, np.ndarray]:
    """W1, W2, W3 and the warm-up from one generator, in the anchor's order (no shared prefixes); ids below `high`."""
    rng = np.random.default_rng(0)
    return {
        "W1": rng.integers(ID_LOW, high, size=(1000, 1024), dtype=np.int64),
        "W2": rng.integers(ID_LOW, high, size=(500, 128), dtype=np.int64),
        "W3": rng.integers(ID_LOW, high, size=(6, 128), dtype=np.int64),
        "warmup": rng.integers(ID_LOW, high, size=(16, 256), dtype=np.int64),
    }


def w4_prompts(n: int, high: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    prefix = [int(x) for x in rng.integers(ID_LOW, high, size=1024, dtype=np.int64)]
    suffixes = rng.integers(ID_LOW, high, size=(1000, 128), dtype=np.int64)[:n]
    return [prefix + [int(x) for x in row] for row in suffixes]


def w5_prompts(n: int, high: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)
    in_lens = rng.integers(100, 1025, size=1000)
    out_lens = rng.integers(100, 1025, size=1000)
    prompts = [[int(x) for x in rng.integers(ID_LOW, high, size=int(n_in), dtype=np.int64)] for n_in in in_lens]
    return prompts[:n], [int(x) for x in out_lens[:n]]


def run_lists(llm: Any, name: str, prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m, detokenize=False) for m in out_lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    res = {
        "workload": name, "num_requests": len(outs), "input_tokens": n_in, "output_tokens": n_out,
        "wall_s": round(wall, 3), "total_tokens_per_s": round((n_in + n_out) / wall, 1),
        "output_tokens_per_s": round(n_out / wall, 1),
        "requests_with_wrong_output_len": sum(len(o.outputs[0].token_ids) != m for o, m in zip(outs, out_lens)),
        "prefix_cache_hit_rate": round(cached / n_in, 4) if n_in else 0.0,
    }
    print(f"[{name}] {json.dumps(res)}", flush=True)
    return res


def single_stream(llm: Any, ids: list[int], out_len: int, rid: str) -> dict[str, Any]:
    from pagedllm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len, detokenize=False)
    stamps: list[float] = []
    seen = 0
    last: Any = None
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)  # cumulative: stamp only the new ones
            stamps.extend([t] * (n - seen))
            seen = n
            last = o.outputs[0]
    token_ids = list(last.token_ids)  # read once, after the timed loop
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "tpot_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3,
            "n_tokens": len(stamps), "token_ids": token_ids}  # greedy ids: A/B runs of one kernel compare them


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 4 GiB, read + write counted (the anchor's `ceilings.py` method)."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 32) / statistics.median(times) / 1e9


def write_model_dir(args: argparse.Namespace, quantization: str | None, overrides: dict[str, Any] | None = None) -> str:
    """The shape's config.json (plus a checkpoint-style quantization_config) in its own folder; the folder."""
    qc = checkpoint_quantization(quantization)
    model_dir = args.model_dir + (f"_{quantization}" if qc else "")  # one folder per config.json
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape_config(args.shape, {**(overrides or {}), **({"quantization_config": qc} if qc else {})}), f)
    return model_dir


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the built model's weights, each shared tensor (a tied head) once.

    Packed weights may live in integer buffers (GGUF blocks, K-major W4A16 words) and W4A16's K-major scales
    and zeros in float ones (w4a16_*); other float buffers are rotary tables, not weights."""
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                  if not b.is_floating_point() or name.rsplit(".", 1)[-1].startswith("w4a16_")))


def decode_read_bytes(model: torch.nn.Module) -> int:
    """The weight bytes one single-stream decode step must read: all of them, except that an input embedding
    the head does not share is only looked up (one row), not streamed."""
    embed = next((m for name, m in model.named_modules() if name.endswith("embed_tokens")), None)
    head = next((m for name, m in model.named_modules() if name.endswith("lm_head")), None)
    table = getattr(embed, "weight", None)
    if table is None or table is getattr(head, "weight", None):
        return weight_bytes(model)
    return weight_bytes(model) - table.numel() * table.element_size() + table[0].numel() * table.element_size()


def start_engine(args: argparse.Namespace, quantization: str | None, utilization: float) -> tuple[Any, dict[str, Any]]:
    """A dummy-weight engine on the chosen shape (config folder written here) and what it holds."""
    from pagedllm import LLM
    from pagedllm.config import EngineConfig

    qc = checkpoint_quantization(quantization)
    model_dir = write_model_dir(args, quantization)
    cfg = EngineConfig.from_dict({
        "model": model_dir, "dtype": "bfloat16", "device": "cuda", "seed": 0,
        "attention": {"backend": args.backend}, "loader": {"name": "dummy"},
        "kv_cache": {"gpu_memory_utilization": utilization},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "async_scheduling": {"auto": None, "on": True, "off": False}[args.async_scheduling]},
        # A checkpoint-style method comes from config.json; an on-the-fly one (fp8) is forced here.
        "quantization": {"method": None if qc else quantization},
        **({"plugins": json.loads(args.plugins)} if args.plugins else {}),
    })
    t0 = time.perf_counter()
    llm = LLM(config=cfg)
    info: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 2),
                            "async_scheduling": llm.engine.core.async_scheduling}
    parts = llm.engine.parts
    info["kv_cache_tokens"] = parts.num_blocks * parts.block_size
    info["selections"] = parts.describe()
    info["weight_bytes"] = weight_bytes(parts.model)
    info["decode_read_bytes"] = decode_read_bytes(parts.model)
    return llm, info


def warm_up(llm: Any, prompts: dict[str, np.ndarray]) -> float:
    from pagedllm import SamplingParams

    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16, detokenize=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": [int(x) for x in row]} for row in prompts["warmup"]], warm, use_tqdm=False)
    return round(time.perf_counter() - t0, 2)


def run_workloads(llm: Any, wanted: list[str], prompts: dict[str, np.ndarray], scale: float, high: int) -> dict[str, Any]:
    def scaled(n: int) -> int:
        # The anchor's rounding (bench_vllm.py), so both engines serve the same requests at any --scale.
        return max(1, int(round(n * scale)))

    w: dict[str, Any] = {}
    if "W1" in wanted:
        rows = prompts["W1"][: scaled(1000)]
        w["W1"] = run_lists(llm, "W1", [[int(x) for x in r] for r in rows], [128] * len(rows))
    if "W2" in wanted:
        rows = prompts["W2"][: scaled(500)]
        w["W2"] = run_lists(llm, "W2", [[int(x) for x in r] for r in rows], [1024] * len(rows))
    if "W3" in wanted:
        reps = [single_stream(llm, [int(x) for x in prompts["W3"][i]], 512, f"w3-{i}") for i in range(3)]
        w["W3"] = {"repeats": reps, "tpot_ms_median": round(statistics.median(r["tpot_ms"] for r in reps), 3),
                   "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in reps), 2)}
        print(f"[W3] {json.dumps(w['W3'])}", flush=True)
    if "W4" in wanted:
        p4 = w4_prompts(scaled(1000), high)
        w["W4"] = run_lists(llm, "W4", p4, [128] * len(p4))
    if "W5" in wanted:
        p5, o5 = w5_prompts(scaled(1000), high)
        w["W5"] = run_lists(llm, "W5", p5, o5)
    return w


def bf16_baseline(args: argparse.Namespace, prompts: dict[str, np.ndarray], copy_gbs: float) -> dict[str, Any]:
    """The bf16 model on `--compare-bf16`'s workloads, its engine shut down and its memory freed on return.

    It runs first, with at most 45 % of the GPU: a build counts whatever is still allocated as in use, so if
    anything outlived the shutdown the quantized engine after it would still find room for its KV cache."""
    llm, info = start_engine(args, None, min(0.45, args.gpu_memory_utilization))
    info["w3_limit_ms"] = round(info["weight_bytes"] / (copy_gbs * 1e9) * 1e3, 3)
    info["warmup_s"] = warm_up(llm, prompts)
    info["workloads"] = run_workloads(llm, args.compare_bf16.split(","), prompts, args.scale, id_high(args.shape))
    llm.shutdown()  # unfreezes the start-up objects (LLM.__del__ NOTE), so the collection below frees them
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=DEFAULT_SHAPE, choices=list(SHAPES),
                    help="model shape (model_shapes.py; default %(default)s)")
    ap.add_argument("--out", default=None,
                    help="result JSON (default $OUT/pagedllm_suite.json, or pagedllm_suite_SHAPE.json for another shape)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of requests for W1/W2/W4/W5")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="vLLM 0.20.0's value on an H200 (the anchor)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--vllm", help="bench_vllm.py's JSON from the same hour, for the side-by-side table")
    ap.add_argument("--model-dir", default=None,
                    help="config folder (default /tmp/llama31_8b_dummy_pagedllm, or /tmp/SHAPE_dummy_pagedllm)")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--quantization", default=None,
                    help="gptq | awq | gguf-<type> (dummy packed weights from a quantization_config) or an "
                         "on-the-fly quantization.method such as fp8")
    ap.add_argument("--compare-bf16", default=None, metavar="WORKLOADS",
                    help="also run the bf16 model on these workloads first (e.g. W3 or W2,W3), same process")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--plugins", default=None, metavar="JSON",
                    help='plugin options for A/B runs, e.g. \'{"triton": {"decode_big_min_seqs": 256}}\'')
    ap.add_argument("--dry-run", action="store_true",
                    help="write the config folder and draw the prompts, then stop (no GPU)")
    ap.add_argument("--cpu-check", type=int, default=None, metavar="LAYERS",
                    help="build the shape on the CPU with LAYERS layers (dummy weights), generate 2 tokens, stop")
    args = ap.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w not in ("W1", "W2", "W3", "W4", "W5")]
    if unknown:
        ap.error(f"--workloads: {', '.join(unknown)} not among W1..W5")
    if args.model_dir is None:
        args.model_dir = default_model_dir(args.shape, "_pagedllm")
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "."), f"pagedllm_suite{result_suffix(args.shape, args.quantization)}.json")
    return args


def dry_run(args: argparse.Namespace, prompts: dict[str, np.ndarray]) -> dict[str, Any]:
    """What a GPU run would build and send: the config folder as written, every prompt id below the vocabulary."""
    model_dir = write_model_dir(args, args.quantization)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    high = id_high(args.shape)
    drawn = [*prompts.values(), np.array(w4_prompts(1000, high)), *map(np.array, w5_prompts(1000, high)[0])]
    top = max(int(arr.max()) for arr in drawn)
    if top >= cfg["vocab_size"]:
        raise ValueError(f"prompt id {top} is outside {args.shape}'s vocabulary of {cfg['vocab_size']}")
    return {"shape": args.shape, "model_dir": model_dir, "architectures": cfg["architectures"],
            "vocab_size": cfg["vocab_size"], "id_range": [ID_LOW, high], "largest_id_drawn": top,
            "workloads": args.workloads, "scale": args.scale, "out": args.out}


def cpu_check(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    """The shape built by the engine on the CPU with `overrides` (`--cpu-check N`: N layers; everything else as
    on the GPU: hidden sizes, vocabulary, dummy weights, bf16) and two greedy tokens from a 16-token prompt of
    the run's ids (ids past an overridden vocabulary wrap into it)."""
    from pagedllm import LLM, SamplingParams

    check = argparse.Namespace(**{**vars(args), "model_dir": args.model_dir + "_cpu"})
    model_dir = write_model_dir(check, args.quantization, overrides)
    vocab = shape_config(args.shape, overrides)["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", device="cpu", dtype="bfloat16", attention_backend="torch",
              block_size=16, num_kv_blocks=64, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128)
    build_s = time.perf_counter() - t0
    prompt = [int(x) % vocab for x in make_prompts(id_high(args.shape))["W3"][0][:16]]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    model = llm.engine.parts.model
    res = {"shape": args.shape, "overrides": overrides, "model_dir": model_dir, "architecture": type(model).__name__,
           "weight_bytes": weight_bytes(model), "decode_read_bytes": decode_read_bytes(model),
           "token_ids": list(out.outputs[0].token_ids), "build_s": round(build_s, 2)}
    llm.shutdown()
    return res


def main() -> int:
    args = parse_args()
    wanted = args.workloads.split(",")
    high = id_high(args.shape)
    prompts = make_prompts(high)
    if args.dry_run or args.cpu_check is not None:
        print(json.dumps(cpu_check(args, {"num_hidden_layers": args.cpu_check}) if args.cpu_check is not None
                         else dry_run(args, prompts)))
        return 0

    result: dict[str, Any] = {"engine": "pagedllm", "shape": args.shape,
                              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "backend": args.backend, "quantization": args.quantization,
                              "quantization_config": checkpoint_quantization(args.quantization), "workloads": {}}
    result["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)

    if args.compare_bf16 and args.quantization:
        result["bf16"] = bf16_baseline(args, prompts, result["copy_bandwidth_gbs"])
        gc.collect()
        torch.cuda.empty_cache()
        result["bf16"]["gpu_bytes_left_after"] = torch.cuda.memory_allocated()

    llm, info = start_engine(args, args.quantization, args.gpu_memory_utilization)
    result.update(info)
    result["w3_limit_ms"] = round(result["weight_bytes"] / (result["copy_bandwidth_gbs"] * 1e9) * 1e3, 3)
    result["w3_read_limit_ms"] = round(result["decode_read_bytes"] / (result["copy_bandwidth_gbs"] * 1e9) * 1e3, 3)
    print(f"shape {args.shape}; startup {result['startup_s']} s; KV {result['kv_cache_tokens']:,} tokens; "
          f"copy {result['copy_bandwidth_gbs']} GB/s; weights {result['weight_bytes'] / 1e9:.2f} GB; "
          f"W3 limit {result['w3_limit_ms']} ms ({result['w3_read_limit_ms']} ms for the bytes a step reads)",
          flush=True)
    print("\n".join(line for line in result["selections"].splitlines() if line.startswith("start-up:")), flush=True)
    if args.quantization:
        result["w4a16_routes"] = w4a16_routes(args.quantization)
        result["w4a16_graph_replay_max_diff"] = graph_replay_check(llm.engine.parts.model)
    result["warmup_s"] = warm_up(llm, prompts)
    result["workloads"] = run_workloads(llm, wanted, prompts, args.scale, high)
    llm.shutdown()

    vllm = None
    if args.vllm and os.path.exists(args.vllm):
        with open(args.vllm) as f:
            vllm = json.load(f)
    result["table"] = table(result, vllm)
    print(result["table"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def w4a16_routes(quantization: str) -> dict[str, str] | None:
    """Which W4A16 kernel each decode batch size of the graph ladder takes (w4a16_kernel.w4a16_route)."""
    qc = checkpoint_quantization(quantization)
    if not qc or qc["quant_method"] not in ("gptq", "awq"):
        return None
    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_route
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

    layout = PackedLayout("gptq", 4, int(qc["group_size"]))  # AWQ runs repacked into the GPTQ order
    return {str(m): w4a16_route(layout, m) for m in (1, 2, 4, 8, 16, 64, 96, 128, 512, 16384)}


def graph_replay_check(model: Any) -> dict[str, Any] | None:
    """One quantized linear (gate_up of layer 0) at 1, 16 and 128 rows -- the GEMV, GEMM and dequantize +
    cuBLAS routes -- eager vs captured in a CUDA graph and replayed: max |difference| (0: graph-safe and
    deterministic). The engine's own capture already ran these routes; this says which one broke, if any."""
    layer = next((m for name, m in model.named_modules() if name.endswith("layers.0.mlp.gate_up_proj")), None)
    if layer is None or "w4a16_layout" not in layer.__dict__:
        return None
    k = layer.qweight.shape[0] * layer.__dict__["w4a16_layout"].pack_factor
    out: dict[str, Any] = {}
    for m in (1, 16, 128):
        try:
            x = torch.randn(m, k, device=layer.qweight.device, dtype=layer.scales.dtype)
            with torch.inference_mode():
                eager = layer(x).clone()
                layer(x)  # a second eager call: lazily made buffers (split-K tickets) exist before capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = layer(x)
                graph.replay()
                torch.cuda.synchronize()
            out[str(m)] = float((captured.float() - eager.float()).abs().max())
        except Exception as exc:  # noqa: BLE001 (reported in the JSON; the benchmark goes on)
            out[str(m)] = f"error: {type(exc).__name__}: {exc}"
    print(f"[graph replay vs eager, max |diff| by rows] {json.dumps(out)}", flush=True)
    return out


def _vllm_figure(vllm: dict[str, Any] | None, name: str) -> float | None:
    if not vllm:
        return None
    row = vllm.get("workloads", vllm).get(name) if isinstance(vllm.get("workloads", vllm), dict) else None
    if not isinstance(row, dict):
        return None
    if name == "W3":
        return row.get("step_tpot_ms_median")
    return row.get("total_tokens_per_s")


def table(ours: dict[str, Any], vllm: dict[str, Any] | None) -> str:
    shape, quant = ours.get("shape", DEFAULT_SHAPE), ours.get("quantization")
    label = shape + (f", {quant}" if quant else "")
    lines = [f"| workload ({label}) | pagedllm | vLLM (same run) | ratio |", "|---|---|---|---|"]
    # A vLLM JSON from before --shape (--quantization) existed ran the default shape (in bf16). Another shape's
    # or another format's figures are no baseline.
    their_run = (vllm.get("shape", DEFAULT_SHAPE), vllm.get("quantization")) if vllm else (shape, quant)
    if their_run != (shape, quant):
        ran = their_run[0] + (f", {their_run[1]}" if their_run[1] else " in bf16" if quant else "")
        lines.append(f"| vLLM's JSON ran {ran}, not {label}: no vLLM figures | | | |")
        vllm = None
    elif vllm and vllm.get("quantization_resolved"):
        lines.append(f"| vLLM's quantization method: {vllm['quantization_resolved']} | | | |")
    for name, row in ours["workloads"].items():
        mine = row["tpot_ms_median"] if name == "W3" else row["total_tokens_per_s"]
        theirs = _vllm_figure(vllm, name)
        unit = "ms/token" if name == "W3" else "total tok/s"
        ratio = "" if not theirs else f"{(theirs / mine if name == 'W3' else mine / theirs):.3f}x"
        lines.append(f"| {name} ({unit}) | {mine:,.2f} | {'-' if theirs is None else f'{theirs:,.2f}'} | {ratio} |")
    if "W3" in ours["workloads"]:
        share = ours["w3_limit_ms"] / ours["workloads"]["W3"]["tpot_ms_median"]
        lines.append(f"| W3 vs weight-streaming limit {ours['w3_limit_ms']} ms | {share:.0%} of the limit | | |")
        read_limit = ours.get("w3_read_limit_ms")
        if read_limit is not None and read_limit != ours["w3_limit_ms"]:
            share = read_limit / ours["workloads"]["W3"]["tpot_ms_median"]
            lines.append(f"| W3 vs the bytes a step reads, {read_limit} ms (untied embedding left out) | "
                         f"{share:.0%} of that limit | | |")
    startup = vllm.get("startup_s") if vllm else None
    lines.append(f"| start-up (s) | {ours['startup_s']} | {'-' if startup is None else f'{startup:.2f}'} | |")
    if "bf16" in ours:
        lines += bf16_lines(ours)
    return "\n".join(lines)


def bf16_lines(ours: dict[str, Any]) -> list[str]:
    """The quantized engine against the bf16 one of the same run (speed-up > 1: the quantized one is faster)."""
    bf16, q = ours["bf16"], ours["quantization"]
    lines = ["", f"| workload | {q} | bf16 (same process) | {q} speed-up |", "|---|---|---|---|"]
    for name, row in bf16["workloads"].items():
        mine = ours["workloads"].get(name)
        theirs = row["tpot_ms_median"] if name == "W3" else row["total_tokens_per_s"]
        if mine is None:
            lines.append(f"| {name} | - | {theirs:,.2f} | |")
            continue
        mine_v = mine["tpot_ms_median"] if name == "W3" else mine["total_tokens_per_s"]
        unit = "ms/token" if name == "W3" else "total tok/s"
        ratio = theirs / mine_v if name == "W3" else mine_v / theirs
        lines.append(f"| {name} ({unit}) | {mine_v:,.2f} | {theirs:,.2f} | {ratio:.2f}x |")
    lines.append(f"| weight bytes (GB) | {ours['weight_bytes'] / 1e9:.2f} | {bf16['weight_bytes'] / 1e9:.2f} | "
                 f"{bf16['weight_bytes'] / ours['weight_bytes']:.2f}x smaller |")
    lines.append(f"| W3 weight-streaming limit (ms) | {ours['w3_limit_ms']} | {bf16['w3_limit_ms']} | |")
    lines.append(f"| start-up (s) | {ours['startup_s']} | {bf16['startup_s']} | |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
