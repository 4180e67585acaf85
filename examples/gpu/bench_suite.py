"""Issue 5's workload suite W1–W5 on one GPU, in one process, the way ../shared/anchors/vllm/bench_vllm.py
measures vLLM 0.20.0 (same model shape, same prompts from the same seeds, same warm-up, same timing):

    python examples/gpu/bench_suite.py --out $OUT/pagedllm_suite.json [--workloads W1,W2,W3,W4,W5]
        [--vllm $OUT/vllm_result.json] [--scale 0.25] [--backend triton]

Llama-3.1-8B shape, bf16, dummy weights, random token ids in [1000, 120000), greedy, ignore_eos.
  W1 1000 x (1024 in, 128 out)     W2 500 x (128 in, 1024 out)     W3 1 x (128 in, 512 out), ms/token
  W4 1000 x (shared 1024-token prefix + 128 unique in, 128 out)   W5 1000 x (in, out uniform in [100, 1024])
Throughput = (input + output tokens) / wall time of one `generate` over all requests. W3 steps the engine by
hand and stamps each token's arrival: (last - first) / (n - 1), median of 3 (vLLM's method).
With `--vllm` (the JSON bench_vllm.py wrote in the same hour) the table shows the ratios side by side.
The W3 hardware limit is printed beside it: weight bytes / measured device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from h200_check import LLAMA_8B_CONFIG  # noqa: E402

ID_LOW, ID_HIGH = 1000, 120000


def make_prompts() -> dict[str, np.ndarray]:
    """W1, W2, W3 and the warm-up from one generator, in the anchor's order (no shared prefixes)."""
    rng = np.random.default_rng(0)
    return {
        "W1": rng.integers(ID_LOW, ID_HIGH, size=(1000, 1024), dtype=np.int64),
        "W2": rng.integers(ID_LOW, ID_HIGH, size=(500, 128), dtype=np.int64),
        "W3": rng.integers(ID_LOW, ID_HIGH, size=(6, 128), dtype=np.int64),
        "warmup": rng.integers(ID_LOW, ID_HIGH, size=(16, 256), dtype=np.int64),
    }


def w4_prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    prefix = [int(x) for x in rng.integers(ID_LOW, ID_HIGH, size=1024, dtype=np.int64)]
    suffixes = rng.integers(ID_LOW, ID_HIGH, size=(1000, 128), dtype=np.int64)[:n]
    return [prefix + [int(x) for x in row] for row in suffixes]


def w5_prompts(n: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)
    in_lens = rng.integers(100, 1025, size=1000)
    out_lens = rng.integers(100, 1025, size=1000)
    prompts = [[int(x) for x in rng.integers(ID_LOW, ID_HIGH, size=int(n_in), dtype=np.int64)] for n_in in in_lens]
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


def single_stream(llm: Any, ids: list[int], out_len: int, rid: str) -> dict[str, float]:
    from pagedllm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len, detokenize=False)
    stamps: list[float] = []
    seen = 0
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)  # cumulative: stamp only the new ones
            stamps.extend([t] * (n - seen))
            seen = n
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "tpot_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3,
            "n_tokens": len(stamps)}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pagedllm_suite.json"))
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of requests for W1/W2/W4/W5")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--vllm", help="bench_vllm.py's JSON from the same hour, for the side-by-side table")
    ap.add_argument("--model-dir", default="/tmp/llama31_8b_dummy_pagedllm")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--quantization", default=None, help="quantization.method, e.g. fp8 (on-the-fly W8A8)")
    args = ap.parse_args()
    wanted = args.workloads.split(",")

    os.makedirs(args.model_dir, exist_ok=True)
    with open(os.path.join(args.model_dir, "config.json"), "w") as f:
        json.dump(LLAMA_8B_CONFIG, f)
    result: dict[str, Any] = {"engine": "pagedllm", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "backend": args.backend, "quantization": args.quantization, "workloads": {}}
    result["copy_bandwidth_gbs"] = round(copy_bandwidth_gbs(), 1)

    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineConfig

    cfg = EngineConfig.from_dict({
        "model": args.model_dir, "dtype": "bfloat16", "device": "cuda", "seed": 0,
        "attention": {"backend": args.backend}, "loader": {"name": "dummy"},
        "kv_cache": {"gpu_memory_utilization": 0.9},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "async_scheduling": {"auto": None, "on": True, "off": False}[args.async_scheduling]},
        "quantization": {"method": args.quantization},
    })
    t0 = time.perf_counter()
    llm = LLM(config=cfg)
    result["startup_s"] = round(time.perf_counter() - t0, 2)
    result["async_scheduling"] = llm.engine.core.async_scheduling
    parts = llm.engine.parts
    result["kv_cache_tokens"] = parts.num_blocks * parts.block_size
    result["selections"] = parts.describe()
    weight_bytes = sum(p.numel() * p.element_size() for p in parts.model.parameters())
    result["weight_bytes"] = weight_bytes
    result["w3_limit_ms"] = round(weight_bytes / (result["copy_bandwidth_gbs"] * 1e9) * 1e3, 3)
    print(f"startup {result['startup_s']} s; KV {result['kv_cache_tokens']:,} tokens; "
          f"copy {result['copy_bandwidth_gbs']} GB/s; W3 limit {result['w3_limit_ms']} ms", flush=True)

    prompts = make_prompts()
    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16, detokenize=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": [int(x) for x in row]} for row in prompts["warmup"]], warm, use_tqdm=False)
    result["warmup_s"] = round(time.perf_counter() - t0, 2)

    def scaled(n: int) -> int:
        return max(1, int(n * args.scale))

    w = result["workloads"]
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
        p4 = w4_prompts(scaled(1000))
        w["W4"] = run_lists(llm, "W4", p4, [128] * len(p4))
    if "W5" in wanted:
        p5, o5 = w5_prompts(scaled(1000))
        w["W5"] = run_lists(llm, "W5", p5, o5)
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
    lines = ["| workload | pagedllm | vLLM (same run) | ratio |", "|---|---|---|---|"]
    for name, row in ours["workloads"].items():
        mine = row["tpot_ms_median"] if name == "W3" else row["total_tokens_per_s"]
        theirs = _vllm_figure(vllm, name)
        unit = "ms/token" if name == "W3" else "total tok/s"
        ratio = "" if not theirs else f"{(theirs / mine if name == 'W3' else mine / theirs):.2f}x"
        lines.append(f"| {name} ({unit}) | {mine:,.2f} | {theirs if theirs is not None else '-'} | {ratio} |")
    if "W3" in ours["workloads"]:
        share = ours["w3_limit_ms"] / ours["workloads"]["W3"]["tpot_ms_median"]
        lines.append(f"| W3 vs weight-streaming limit {ours['w3_limit_ms']} ms | {share:.0%} of the limit | | |")
    lines.append(f"| start-up (s) | {ours['startup_s']} | {vllm.get('startup_s', '-') if vllm else '-'} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
