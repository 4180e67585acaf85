"""`pagedllm top`'s reading of /metrics, without a server: prometheus_client's own exposition of known
observations, parsed back; bucket percentiles against numpy's on the same data; the two-scrape window."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.plugins.commands.top.scrape import ScrapeError, parse
from pagedllm.plugins.commands.top.view import render, summary

BUCKETS = [i / 100 for i in range(1, 101)]  # 10 ms wide, up to 1 s


def exposition(prefix: str, ttfts: list[float], generated: int) -> str:
    r = CollectorRegistry()
    Gauge(f"{prefix}num_requests_running", "running", ["model_name"], registry=r).labels("m").set(3)
    Counter(f"{prefix}generation_tokens", "generated", ["model_name"], registry=r).labels("m").inc(generated)
    h = Histogram(f"{prefix}time_to_first_token_seconds", "ttft", ["model_name"], buckets=BUCKETS, registry=r)
    for t in ttfts:
        h.labels("m").observe(t)
    return generate_latest(r).decode()


@pytest.mark.parametrize("prefix", ["pagedllm:", "vllm:"])
def test_parse_reads_either_prefix(prefix: str) -> None:
    rng = np.random.default_rng(1)
    ttfts = list(rng.uniform(0.05, 0.95, 2000))
    snap = parse(exposition(prefix, ttfts, 77))
    assert snap.prefix == prefix
    assert snap.value("num_requests_running") == 3 and snap.value("generation_tokens") == 77
    h = snap.histograms["time_to_first_token_seconds"]
    assert h.count == 2000 and h.sum == pytest.approx(sum(ttfts))
    for q in (0.5, 0.9, 0.99):  # within one 10 ms bucket of the exact percentile
        assert h.quantile(q) == pytest.approx(np.percentile(ttfts, 100 * q), abs=0.01)
    assert summary(snap, None)["model"] == "m"


def test_window_covers_only_the_new_observations() -> None:
    first = parse(exposition("pagedllm:", [0.1] * 10, 5))
    second = parse(exposition("pagedllm:", [0.1] * 10 + [0.8] * 5, 25))
    second.time = first.time + 2.0
    recent = summary(second, first)["time_to_first_token_seconds"]
    assert recent["count"] == 5 and recent["mean"] == pytest.approx(0.8)
    screen = "\n".join(render(second, first, "http://x"))
    assert "generated       10.0" in screen  # (25 - 5) tokens over 2 s
    assert "latency (last 2.0 s)" in screen


def test_not_prometheus_text_is_named() -> None:
    with pytest.raises(ScrapeError, match="no pagedllm: or vllm: metrics"):
        parse("# HELP other_metric x\n# TYPE other_metric gauge\nother_metric 1\n")
