"""`pagedllm bench serve`: an async load generator against any OpenAI-compatible server (ours or another's).

Arrivals: Poisson at --request-rate (default), fixed-interval (--arrival fixed), or all at once; in every case
--max-concurrency caps requests in flight. Prompts: random words (about --input-len tokens each) or lines of
--prompts-file. Each request streams (`stream_options.include_usage`) so TTFT and inter-token latency are
measured at the client, as a user sees them:

    send ──── first content chunk ──── chunk ── chunk ── ... ── [DONE]
    |<-- TTFT -->|<---- ITL ---->|<-ITL->|                      |
    |<------------------------------ E2E ---------------------->|

Only httpx is needed; nothing here imports torch, so it can drive a remote server from a thin client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly",
    "hum", "about", "time", "space", "light", "river", "mountain", "story", "engine", "paper", "garden", "window",
    "music", "number", "silver", "green",
]


@dataclass
class ServeLoadConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"  # or "chat"
    num_prompts: int = 32
    input_len: int = 64
    output_len: int = 64
    request_rate: float = math.inf  # requests/s; inf = all at once
    arrival: str = "poisson"  # or "fixed"
    max_concurrency: int | None = None
    prompts_file: str | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_prompts(cfg: ServeLoadConfig) -> list[str]:
    if cfg.prompts_file:
        with open(cfg.prompts_file) as f:
            lines = [line.strip() for line in f if line.strip()]
        if not lines:
            raise ValueError(f"{cfg.prompts_file} has no prompts")
        return [lines[i % len(lines)] for i in range(cfg.num_prompts)]
    rng = random.Random(cfg.seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(cfg.input_len)) for _ in range(cfg.num_prompts)]


def _payload(cfg: ServeLoadConfig, prompt: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": cfg.output_len, "temperature": 0.0, "stream": True,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def _one(http: Any, cfg: ServeLoadConfig, prompt: str) -> RequestResult:
    path, body = _payload(cfg, prompt)
    start = time.perf_counter()
    last = start
    res = RequestResult(ok=False)
    chunks = 0
    try:
        async with http.stream("POST", cfg.base_url.rstrip("/") + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                if event.get("usage"):
                    res.output_tokens = int(event["usage"].get("completion_tokens", 0))
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # a refused connection or timeout is a failed request, not a crashed benchmark
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


def _delays(cfg: ServeLoadConfig) -> list[float]:
    if math.isinf(cfg.request_rate) or cfg.request_rate <= 0:
        return [0.0] * cfg.num_prompts
    rng = random.Random(cfg.seed + 1)
    if cfg.arrival == "fixed":
        return [1.0 / cfg.request_rate] * cfg.num_prompts
    return [rng.expovariate(cfg.request_rate) for _ in range(cfg.num_prompts)]


async def run_load(cfg: ServeLoadConfig) -> dict[str, Any]:
    """Send every prompt per the arrival process; return the summary (see `summarize`)."""
    import httpx

    prompts = make_prompts(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limit = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
    limits = httpx.Limits(max_connections=cfg.max_concurrency or cfg.num_prompts)

    async with httpx.AsyncClient(timeout=cfg.timeout_s, headers=headers, limits=limits) as http:

        async def gated(prompt: str) -> RequestResult:
            async with limit:
                return await _one(http, cfg, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt, delay in zip(prompts, _delays(cfg)):
            tasks.append(asyncio.create_task(gated(prompt)))
            if delay:
                await asyncio.sleep(delay)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(cfg, list(results), duration)


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(cfg: ServeLoadConfig, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(cfg).items()
                   if k != "api_key"},
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:10],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "ttft_s": _pcts([r.ttft for r in ok]),
        "itl_s": _pcts([x for r in ok for x in r.itls]),
        "e2e_s": _pcts([r.e2e for r in ok]),
        # Raw times for --plot (plots.py); popped before the JSON is written.
        "_samples": {"ttft_ms": [r.ttft * 1e3 for r in ok], "itl_ms": [x * 1e3 for r in ok for x in r.itls],
                     "e2e_ms": [r.e2e * 1e3 for r in ok]},
    }


def format_report(summary: dict[str, Any]) -> str:
    lines = [
        f"completed {summary['completed']} / failed {summary['failed']} in {summary['duration_s']:.2f}s",
        f"request throughput: {summary['request_throughput']:.2f} req/s",
        f"output throughput:  {summary['output_throughput']:.1f} tok/s ({summary['output_tokens']} tokens)",
    ]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = summary[key]
        lines.append(f"{label:5s} ms: mean {s['mean'] * 1e3:8.1f}  p50 {s['p50'] * 1e3:8.1f}  "
                     f"p90 {s['p90'] * 1e3:8.1f}  p99 {s['p99'] * 1e3:8.1f}")
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `pagedllm bench serve` (declared by cli.py)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model id to send (default: the server's)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64, help="random prompt length in words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default: all at once)")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--prompts-file", default=None, help="prompts, one per line, instead of random words")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the summary as JSON to this file")
    p.add_argument("--plot", metavar="FILE", help="TTFT, inter-token and end-to-end latency distributions "
                   "(.png, .svg or .pdf; needs pagedllm[plot])")


def run_serve_cli(args: argparse.Namespace) -> int:
    from pagedllm.plugins.commands.bench import plots

    if args.plot:
        plots.require_matplotlib(args.plot)  # before the load runs: a missing matplotlib costs no run
    cfg = ServeLoadConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, request_rate=args.request_rate,
        arrival=args.arrival, max_concurrency=args.max_concurrency, prompts_file=args.prompts_file,
        api_key=args.api_key, seed=args.seed,
    )
    summary = asyncio.run(run_load(cfg))
    samples = summary.pop("_samples")
    print(format_report(summary))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        plots.plot_serve(args.plot, samples, summary)
    return 0 if summary["failed"] == 0 else 1
