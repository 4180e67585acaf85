"""Runs one vLLM baseline job in vLLM's own interpreter: `PYTHON vllm_runner.py JOB.json RESULT.json`.

This file is executed as a script by another virtual environment's Python (the one vLLM CPU is installed
in), never imported by pagedllm: it imports only the standard library and `vllm`, and speaks to the bench
through two JSON files (vllm_baseline.py writes the job and reads the result). Timings are taken here, in
the process that runs vLLM; the parent checks the token counts against its workload.

The job: {"mode": "throughput" | "latency", "engine": {LLM keyword arguments}, "warmup": [[ids], [lens]] or
null, "prompts": [[ids]...], "output_lens": [n...]} for throughput, or "iterations": [[[ids]...]...] and
"output_len": n for latency. The result: {"ok": true, "startup": {...}, "engine": {...}, "run": {...}} or
{"ok": false, "error": "..."}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def _params(vllm: Any, n: int, delta: bool = False) -> Any:
    """Greedy, exactly n tokens (ignore_eos), no detokenization: the bench's request for every engine."""
    kind: dict[str, Any] = {}
    if delta:
        kind["output_kind"] = vllm.sampling_params.RequestOutputKind.DELTA
    return vllm.SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False,
                               **kind)


def _prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def _generate(vllm: Any, llm: Any, prompts: list[list[int]], lens: list[int]) -> list[Any]:
    return list(llm.generate(_prompts(prompts), [_params(vllm, n) for n in lens], use_tqdm=False))


def run_throughput(vllm: Any, llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One `LLM.generate` over every request, timed; the tokens each request made, counted from its output."""
    t0 = time.perf_counter()
    outputs = _generate(vllm, llm, job["prompts"], job["output_lens"])
    elapsed = time.perf_counter() - t0
    return {
        "elapsed_s": elapsed,
        "prompt_lens": [len(o.prompt_token_ids) for o in outputs],
        "output_lens": [len(o.outputs[0].token_ids) for o in outputs],
        "num_cached_tokens": sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs),
    }


def run_latency(vllm: Any, llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Each iteration's batch added at once, then the engine stepped; every token stamped as it arrives.

    RequestOutput.metrics holds only the first and last token's engine-core times, so the per-token times
    come from stepping the engine here: the same place our engine's token times are taken (as outputs
    reach the caller).
    """
    engine = llm.llm_engine
    n = int(job["output_len"])
    ttfts: list[float] = []
    itls: list[float] = []
    e2e: list[float] = []
    made: list[int] = []
    for it, batch in enumerate(job["iterations"]):
        stamps: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        for i, prompt in enumerate(batch):
            rid = f"lat-{it}-{i}"
            stamps[rid] = []
            engine.add_request(rid, {"prompt_token_ids": prompt}, _params(vllm, n, delta=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                stamps[out.request_id] += [now] * len(out.outputs[0].token_ids)
        e2e.append(time.perf_counter() - t0)
        for times in stamps.values():
            made.append(len(times))
            if times:
                ttfts.append(times[0] - t0)
                itls += [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"ttfts": ttfts, "itls": itls, "e2e": e2e, "output_lens": made}


def _engine_facts(llm: Any) -> dict[str, Any]:
    """The settings vLLM resolved that change the numbers (its scheduler limits, KV layout, compile mode)."""
    facts: dict[str, Any] = {}
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    if cfg is None:
        return facts
    sched, cache = cfg.scheduler_config, cfg.cache_config
    facts["max_num_seqs"] = getattr(sched, "max_num_seqs", None)
    facts["max_num_batched_tokens"] = getattr(sched, "max_num_batched_tokens", None)
    facts["enable_chunked_prefill"] = getattr(sched, "enable_chunked_prefill", None)
    facts["block_size"] = getattr(cache, "block_size", None)
    facts["enable_prefix_caching"] = getattr(cache, "enable_prefix_caching", None)
    facts["kv_cache_memory_bytes"] = getattr(cache, "kv_cache_memory_bytes", None)
    facts["max_model_len"] = getattr(cfg.model_config, "max_model_len", None)
    facts["dtype"] = str(getattr(cfg.model_config, "dtype", "")).removeprefix("torch.")
    facts["compilation_mode"] = str(getattr(cfg.compilation_config, "mode", ""))
    return facts


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(job_path: str, result_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    result: dict[str, Any]
    try:
        t0 = time.perf_counter()
        import vllm

        t_import = time.perf_counter()
        llm = vllm.LLM(**job["engine"])
        t_init = time.perf_counter()
        warm = job.get("warmup")
        if warm:
            _generate(vllm, llm, warm[0], warm[1])
        t_warm = time.perf_counter()
        run = run_throughput(vllm, llm, job) if job["mode"] == "throughput" else run_latency(vllm, llm, job)
        result = {
            "ok": True,
            "startup": {"import_s": t_import - t0, "engine_init_s": t_init - t_import, "warmup_s": t_warm - t_init},
            "engine": _engine_facts(llm),
            "versions": {"vllm": getattr(vllm, "__version__", "?"), "torch": _version("torch"),
                         "python": sys.version.split()[0]},
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")},
            "run": run,
        }
    except BaseException as exc:  # anything vLLM raises is the baseline's reason to be skipped, reported
        tail = traceback.format_exc().strip().splitlines()[-6:]
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
