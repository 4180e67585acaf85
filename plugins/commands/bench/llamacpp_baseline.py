"""The llama.cpp baseline (llama-cpp-python): the same GGUF file, the same prompt ids, greedy, same lengths.

`Llama` decodes one sequence at a time, so its throughput is sequential: it is the single-stream anchor
that a batching engine should beat on many requests and approach on one.

NOTE(1): llama.cpp runs in a spawned child process. Our process already holds torch's OpenMP pool and ggml
brings its own; on 2 cores, workers of one pool spinning while the other computes can only cost llama.cpp
time (a loaded-machine check saw 5-12 decode tok/s in-process against 10-51 in a child: noisy, but the
isolation is free and removes the question).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pagedllm.plugins.commands.bench.report import Result, gaps, latency_result
from pagedllm.plugins.commands.bench.target import BenchTarget
from pagedllm.plugins.commands.bench.workloads import Workload


def unavailable_reason(target: BenchTarget) -> str | None:
    """Why llama.cpp cannot run here (None: it can). A missing package is a reason, not a crash."""
    if target.gguf_path is None:
        return f"llama.cpp needs a GGUF model; this run's model was read by the '{target.loader}' loader"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ("llama_cpp is not installed; see docs/benchmarks.md, e.g. CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install llama-cpp-python==0.3.36")
    return None


def load_llamacpp(gguf: str, threads: int, n_ctx: int) -> Any:
    """A `Llama` on `threads` threads for prompt and decode alike (the same count torch uses)."""
    from llama_cpp import Llama

    return Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)


def _decode(llama: Any, prompt: list[int], n: int, stamps: list[float] | None = None) -> None:
    """Greedy-decode exactly n tokens after `prompt`, from an empty KV cache; note each token's time."""
    # NOTE(1): reset() zeroes the cached length, so generate() cannot reuse the previous request's
    # prefix; prefix reuse would flatter llama.cpp on repeated prompts (ours is reported separately).
    llama.reset()
    # temp=0 selects llama.cpp's greedy sampler; generate() never stops at EOS by itself (ignore_eos).
    tokens = llama.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    for made, _token in enumerate(tokens, start=1):
        if stamps is not None:
            stamps.append(time.perf_counter())
        if made == n:
            break


def run_isolated(job: Callable[..., Result], *args: Any) -> Result:
    """Run `job(*args)` in a fresh spawned process and return its result (see NOTE(1))."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(job, *args).result()


def throughput_job(gguf: str, threads: int, workload: Workload, warmup: bool) -> Result:
    """Child-process body of the throughput baseline: load, then time every request in turn."""
    n_ctx = max(len(p) + o for p, o in zip(workload.prompts, workload.output_lens, strict=True)) + 16
    return llamacpp_throughput(load_llamacpp(gguf, threads, n_ctx), workload, warmup)


def latency_job(gguf: str, threads: int, iterations: list[list[list[int]]], output_len: int, warmup: bool) -> Result:
    """Child-process body of the latency baseline."""
    n_ctx = len(iterations[0][0]) + output_len + 16
    return llamacpp_latency(load_llamacpp(gguf, threads, n_ctx), iterations, output_len, warmup)


def llamacpp_throughput(llama: Any, workload: Workload, warmup: bool = True) -> Result:
    """Every request in turn; tok/s counts prompt and output tokens over the total wall time."""
    if warmup:
        _decode(llama, workload.prompts[0][:8], 4)
    t0 = time.perf_counter()
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        _decode(llama, prompt, n)
    elapsed = time.perf_counter() - t0
    return {
        "num_requests": len(workload),
        "elapsed_s": elapsed,
        "requests_per_s": len(workload) / elapsed,
        "output_tok_per_s": workload.output_tokens / elapsed,
        "total_tok_per_s": (workload.prompt_tokens + workload.output_tokens) / elapsed,
        "batch_size": 1,
    }


def llamacpp_latency(llama: Any, iterations: list[list[list[int]]], output_len: int, warmup: bool = True) -> Result:
    """Single-stream latency: each iteration's one prompt decoded with a timestamp per token."""
    if warmup:
        _decode(llama, iterations[0][0][:8], 4)
    ttfts: list[float] = []
    itls: list[float] = []
    e2e: list[float] = []
    for batch in iterations:
        assert len(batch) == 1, "llama.cpp latency is single-stream"
        times: list[float] = []
        t0 = time.perf_counter()
        _decode(llama, batch[0], output_len, stamps=times)
        e2e.append(time.perf_counter() - t0)
        ttfts.append(times[0] - t0)
        itls += gaps(times)
    return latency_result(ttfts, itls, e2e, 1, len(iterations[0][0]), output_len)
