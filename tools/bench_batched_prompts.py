"""32 prompts in one /v1/completions request against the same 32 prompts as 32 concurrent requests (issue 26).

Every prompt of a batched request is its own engine request, all submitted at once, so the batched request
should take about as long as the concurrent ones (target: within 1.2x). Starts `pagedllm serve` on loopback
with the embedded default model (SmolLM2-135M-Instruct Q4_1) unless --url names a running server.

    python tools/bench_batched_prompts.py [--prompts 32] [--max-tokens 32] [--rounds 3] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

TOPICS = ["the sea", "a mountain", "bread", "a library", "rain", "a violin", "the moon", "a garden", "snow",
          "a train", "coffee", "a river", "an owl", "the desert", "a lighthouse", "autumn"]


def prompts(k: int) -> list[str]:
    return [f"Write one sentence about {TOPICS[i % len(TOPICS)]} (variant {i}):" for i in range(k)]


@contextmanager
def server(extra: list[str]) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "pagedllm.cli.serve_cmd", "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server not healthy after 600 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


async def one_request(http: httpx.AsyncClient, url: str, batch: list[str], max_tokens: int) -> int:
    body = {"prompt": batch, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


async def engine_steps(http: httpx.AsyncClient, url: str) -> float:
    for line in (await http.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("pagedllm:engine_steps_total"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def measure(url: str, k: int, max_tokens: int, rounds: int) -> tuple[float, float, float, float]:
    """Median seconds and engine steps of (one k-prompt request, k concurrent requests)."""
    ps = prompts(k)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=k + 4)) as http:
        await one_request(http, url, ps[:2], 4)  # warm
        batched, concurrent, batched_steps, concurrent_steps = [], [], [], []
        for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
            s0, t0 = await engine_steps(http, url), time.perf_counter()
            assert await one_request(http, url, ps, max_tokens) == k * max_tokens
            batched.append(time.perf_counter() - t0)
            batched_steps.append(await engine_steps(http, url) - s0)
            s0, t0 = await engine_steps(http, url), time.perf_counter()
            done = await asyncio.gather(*(one_request(http, url, [p], max_tokens) for p in ps))
            assert sum(done) == k * max_tokens
            concurrent.append(time.perf_counter() - t0)
            concurrent_steps.append(await engine_steps(http, url) - s0)
    med = statistics.median
    return med(batched), med(concurrent), med(batched_steps), med(concurrent_steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--url", default=None, help="a running server (default: start one with the embedded model)")
    ap.add_argument("--num-threads", type=int, default=None, help="passed to the started server")
    args = ap.parse_args()
    extra = ["--max-num-seqs", str(max(64, args.prompts))]
    if args.num_threads:
        extra += ["--num-threads", str(args.num_threads)]

    def run(url: str) -> tuple[float, float, float, float]:
        return asyncio.run(measure(url, args.prompts, args.max_tokens, args.rounds))

    if args.url:
        batched, concurrent, b_steps, c_steps = run(args.url)
    else:
        with server(extra) as url:
            batched, concurrent, b_steps, c_steps = run(url)
    print(f"{args.prompts} prompts x {args.max_tokens} tokens, median of {args.rounds}: one request "
          f"{batched:.2f} s ({b_steps:.0f} engine steps), {args.prompts} concurrent requests {concurrent:.2f} s "
          f"({c_steps:.0f} steps), ratio {batched / concurrent:.2f}x (target <= 1.2x); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
