"""What the online path costs on the CPU: `pagedllm serve` on a tiny dummy model, many short streams at once.

    python tools/online_cpu_profile.py MODEL_DIR [--concurrency 256] [--num-prompts 512] [--output-len 32]
                                                 [--py-spy api.svg] [--json OUT]

MODEL_DIR holds a config.json (a two-layer Llama is plenty: the model's own time is not what is measured) and
the tokenizer files whose vocabulary it matches. One server, one load run (`pagedllm bench serve`, streaming
/v1/completions, ignore_eos), then per process -- the API process (HTTP, tokenizer, detokenizer, SSE) and the
engine core -- the CPU seconds it spent during the run (utime + stime from /proc, so the load generator's own
work on the same cores is not counted), per 1,000 output tokens. The load average before and after is printed
with it: on a shared machine the req/s move with it, the CPU seconds much less.
With --py-spy FILE the API process is sampled during the run (py-spy record, flame graph or --format speedscope).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, in seconds (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def engine_core_pid(api_pid: int) -> int:
    for pid in children(api_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise RuntimeError("no engine-core child process found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--py-spy", metavar="FILE", default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--log", default="/tmp/online_cpu_profile_server.log")
    args = ap.parse_args(argv)

    from pagedllm.plugins.commands.bench.serve_load import ServeLoadConfig, format_report, run_load

    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli.serve_cmd", args.model, "--load-format", "dummy", "--port", str(port),
           "--max-num-seqs", str(args.concurrency), "--max-model-len", "1024", "--num-threads", "1",
           "--log-level", "warning", "--no-ui"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(args.log, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    spy = None
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}; see {args.log}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server not healthy after 300 s; see {args.log}")
            time.sleep(0.5)
        core = engine_core_pid(proc.pid)
        warm = ServeLoadConfig(base_url=url, num_prompts=8, input_len=args.input_len, output_len=4)
        asyncio.run(run_load(warm))  # first-request costs (template, tokenizer caches) stay out of the run
        cfg = ServeLoadConfig(base_url=url, num_prompts=args.num_prompts, input_len=args.input_len,
                              output_len=args.output_len, max_concurrency=args.concurrency)
        if args.py_spy:
            fmt = "speedscope" if args.py_spy.endswith(".json") else "flamegraph"
            spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-o", args.py_spy, "-f", fmt,
                                    "-r", "50", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        load_before = os.getloadavg()
        api0, core0, t0 = cpu_seconds(proc.pid), cpu_seconds(core), time.time()
        summary = asyncio.run(run_load(cfg))
        api1, core1, t1 = cpu_seconds(proc.pid), cpu_seconds(core), time.time()
        load_after = os.getloadavg()
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary.pop("_samples", None)
    per_k = 1000.0 / max(summary["output_tokens"], 1)
    result: dict[str, Any] = {
        "load": summary,
        "api_cpu_s": api1 - api0, "core_cpu_s": core1 - core0,
        "api_cpu_s_per_1k_tokens": (api1 - api0) * per_k, "core_cpu_s_per_1k_tokens": (core1 - core0) * per_k,
        "api_pid": proc.pid, "core_pid": core, "window": [t0, t1],
        "loadavg_before": load_before, "loadavg_after": load_after, "cpus": os.cpu_count(),
    }
    print(format_report(summary))
    print(f"API process: {result['api_cpu_s']:.2f} CPU s ({result['api_cpu_s_per_1k_tokens']:.3f} per 1k output "
          f"tokens); engine core: {result['core_cpu_s']:.2f} CPU s ({result['core_cpu_s_per_1k_tokens']:.3f} per 1k)")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
