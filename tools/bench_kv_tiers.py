"""The KV tiers' benchmark: a shared-prefix, multi-turn workload whose prefixes outgrow the device pool, run
without a connector, with the host tier, and with host + disk tiers, one engine after the other, in one run.

    python tools/bench_kv_tiers.py --out kv_tiers.json                       # CPU, the embedded SmolLM2
    python tools/bench_kv_tiers.py --model DIR --load-format dummy --device cuda --dtype bfloat16 \\
        --num-prefixes 64 --prefix-len 2048 --device-blocks 4096 --out $OUT/kv_tiers.json   # GPU (device recipe)

Workload (W4-like, multi-turn): `--num-prefixes` conversations, each opening with its own `--prefix-len`-token
system prompt; in turn t (of `--turns`) each conversation sends its prompt so far plus a new `--turn-len`-token
user turn, all conversations of a turn at once, and the turn's requests generate `--max-tokens` greedy tokens.
The device pool (`--device-blocks`) is sized below the prefixes' total, so by the time a conversation comes
back its prefix has been evicted from the device: without a tier it is recomputed, with one it is copied back.

Measured per mode: TTFT (each request's first token minus its turn's start; p50 / p99 over all requests),
throughput ((prompt + output tokens) / wall time over all turns), tokens served by each tier, and whether the
greedy tokens equal the no-connector run's. The JSON also records the machine, torch, the git commit and the
load average before and after each mode (the CPU numbers are noisy on shared cores: read them with the load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

MODES = ("none", "host", "host+disk")


def build_turns(args: argparse.Namespace) -> list[list[list[int]]]:
    """turns[t][c]: conversation c's prompt in turn t (its prefix, then its user turns 0..t)."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.id_low, args.id_high) for _ in range(n)]

    convs = [ids(args.prefix_len) for _ in range(args.num_prefixes)]
    turns = []
    for _ in range(args.turns):
        for c in range(len(convs)):
            convs[c] = convs[c] + ids(args.turn_len)
        turns.append([list(p) for p in convs])
    return turns


def engine_config(args: argparse.Namespace, mode: str, disk_dir: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "seed": 0,
        "kv_cache": {"num_blocks": args.device_blocks, "block_size": args.block_size,
                     "enable_prefix_caching": True},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
    }
    if args.load_format:
        cfg["loader"] = {"name": args.load_format}
    if args.num_threads:
        cfg["num_threads"] = args.num_threads
    if mode != "none":
        tiered: dict[str, Any] = {"host_gb": args.host_gb}
        if mode == "host+disk":
            tiered = {"host_gb": args.small_host_gb, "disk_dir": disk_dir, "disk_gb": args.disk_gb}
        cfg["kv_transfer"] = {"kv_connector": "tiered"}
        cfg["plugins"] = {"tiered": tiered}
    return cfg


def run_mode(args: argparse.Namespace, mode: str, turns: list[list[list[int]]]) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import EngineConfig

    disk_dir = tempfile.mkdtemp(prefix="kv_tiers_", dir=args.disk_root)
    load_before = os.getloadavg()
    llm = LLM(config=EngineConfig.from_dict(engine_config(args, mode, disk_dir)))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens, detokenize=False)
    # Warm-up on prompts of other ids (compiles, allocator), then the timed turns.
    llm.generate([{"prompt_token_ids": [args.id_low + 1] * 64}], params, use_tqdm=False)
    ttft: list[float] = []
    tokens: list[list[int]] = []
    cached = 0
    t_start = time.perf_counter()
    for t, prompts in enumerate(turns):
        turn_start = time.perf_counter()
        first: dict[str, float] = {}
        final: dict[str, Any] = {}
        for c, p in enumerate(prompts):
            engine.add_request(f"t{t}c{c}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = time.perf_counter()
                if out.finished:
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    final[out.request_id] = out
        ttft += [first[f"t{t}c{c}"] - turn_start for c in range(len(prompts))]
        for c in range(len(prompts)):
            out = final[f"t{t}c{c}"]
            tokens.append(list(out.outputs[0].token_ids))
            cached += out.num_cached_tokens
    wall = time.perf_counter() - t_start
    stats = llm.get_stats()
    connector = engine.parts.runner.kv_connector
    if connector is not None:
        connector.flush()
    n_in = sum(len(p) for prompts in turns for p in prompts)
    n_out = sum(map(len, tokens))
    result = {
        "mode": mode, "wall_s": round(wall, 3),
        "total_tokens_per_s": round((n_in + n_out) / wall, 1), "output_tokens_per_s": round(n_out / wall, 1),
        "ttft_ms_p50": round(_percentile(ttft, 50) * 1e3, 2), "ttft_ms_p99": round(_percentile(ttft, 99) * 1e3, 2),
        "ttft_ms_mean": round(statistics.fmean(ttft) * 1e3, 2),
        "prompt_tokens": n_in, "output_tokens": n_out,
        "cached_prompt_tokens": cached, "cached_fraction": round(cached / n_in, 4),
        "device_prefix_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "tier_hit_rates": {k: round(v, 4) for k, v in stats.kv_connector_hit_rates.items()},
        "kv_connector": dict(stats.kv_connector),
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "tokens": tokens,
    }
    llm.shutdown()
    shutil.rmtree(disk_dir, ignore_errors=True)
    return result


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: with few requests, p99 is the slowest one)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model reference (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default=None, help="loader, e.g. dummy (random weights, config.json only)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: the engine's choice)")
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=80,
                    help="device KV pool in blocks: below the prefixes' total so they do not stay on the device")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--host-gb", type=float, default=4.0, help="host tier in the 'host' mode (holds everything)")
    ap.add_argument("--small-host-gb", type=float, default=None,
                    help="host tier in the 'host+disk' mode (default: a quarter of the prefixes' KV)")
    ap.add_argument("--disk-gb", type=float, default=20.0)
    ap.add_argument("--disk-root", default=None, help="where the disk tier's temporary directory goes")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--id-low", type=int, default=100)
    ap.add_argument("--id-high", type=int, default=40000)
    ap.add_argument("--out", required=True, help="JSON result file")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    pool_tokens = args.device_blocks * args.block_size
    prefix_tokens = args.num_prefixes * args.prefix_len
    if prefix_tokens <= pool_tokens:
        ap.error(f"the prefixes ({prefix_tokens} tokens) fit the device pool ({pool_tokens}): raise --num-prefixes "
                 "or --prefix-len, or lower --device-blocks")
    turns = build_turns(args)
    longest = max(len(p) for p in turns[-1]) + args.max_tokens
    if longest > pool_tokens:
        ap.error(f"the last turn's prompts need {longest} tokens, more than the device pool holds ({pool_tokens})")
    if args.small_host_gb is None:
        args.small_host_gb = _quarter_of_prefixes_gb(args)
    report: dict[str, Any] = {"machine": machine(), "args": vars(args), "device_pool_tokens": pool_tokens,
                              "prefix_tokens": prefix_tokens, "modes": {}}
    for mode in modes:
        res = run_mode(args, mode, turns)
        report["modes"][mode] = res
        print(f"[{mode}] " + json.dumps({k: v for k, v in res.items() if k not in ("tokens", "kv_connector")}),
              flush=True)
    base = report["modes"]["none"]["tokens"] if "none" in report["modes"] else None
    for res in report["modes"].values():
        tokens = res.pop("tokens")
        res["tokens_equal_none"] = tokens == base if base is not None else None
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({m: {k: r[k] for k in ("ttft_ms_p50", "ttft_ms_p99", "total_tokens_per_s", "cached_fraction",
                                            "tokens_equal_none")} for m, r in report["modes"].items()}, indent=1))
    return 0 if all(r["tokens_equal_none"] is not False for r in report["modes"].values()) else 1


def _quarter_of_prefixes_gb(args: argparse.Namespace) -> float:
    """A quarter of the prefixes' KV in GiB, from a probe engine's cache tensors (one build of the 'none' mode)."""
    from pagedllm import LLM
    from pagedllm.config import EngineConfig

    probe = LLM(config=EngineConfig.from_dict(engine_config(args, "none", "")))
    tensors = {t.data_ptr(): t for t in probe.engine.parts.runner.kv_caches}  # layers may share one
    per_block = sum(t.numel() * t.element_size() for t in tensors.values()) / args.device_blocks
    probe.shutdown()
    return per_block * args.num_prefixes * args.prefix_len / args.block_size / 4 / 2**30


if __name__ == "__main__":
    raise SystemExit(main())
