"""Prometheus metrics for /metrics (names follow vLLM's, with the `pagedllm:` prefix, and every one of them
exported again under vLLM's `vllm:` prefix, so dashboards and alerts written for vLLM work unchanged).

Two sources: the engine core's latest SchedulerStats (running/waiting, KV usage, prefix cache, preemptions),
read at scrape time by a custom collector so they are never stale by more than one core message; and the
final RequestOutput of every request (token counters, TTFT / inter-token / end-to-end histograms).
Each app owns its registry, so two apps in one process do not clash.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.api.engine import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineStatsCollector:
    """Gauges and counters straight from the engine core's last stats message."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats
        model = self.engine.model_name

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        yield gauge("pagedllm:num_requests_running", "Sequences in the engine core's running batch.", s.num_running)
        yield gauge("pagedllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("pagedllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage)
        yield gauge("pagedllm:prefix_cache_hit_rate", "Prefix-cache hits / queries since start (tokens).",
                    s.prefix_cache_hit_rate)
        yield counter("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("pagedllm:engine_steps", "Scheduler steps the engine core has run (since its start).",
                      s.num_steps)
        yield counter("pagedllm:num_preemptions", "Requests preempted (recomputed later) since start.",
                      s.num_preemptions)
        yield gauge("pagedllm:engine_healthy", "1 while the engine-core process is alive.",
                    1.0 if self.engine.healthy else 0.0)
        # Rendered as pagedllm:engine_core_restarts_total; the gauges above read 0 from the moment the core
        # dies (AsyncLLM NOTE 3) until a restarted one reports.
        yield counter("pagedllm:engine_core_restarts", "Engine-core processes respawned after a death.",
                      self.engine.restarts)
        yield from _spec_decode_metrics(s, model, gauge, counter)


def _spec_decode_metrics(s: Any, model: str, gauge: Any, counter: Any) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names): drafts verified, draft tokens, accepted ones, by position."""
    yield counter("pagedllm:spec_decode_num_drafts", "Draft verifications (one per request per step).",
                  s.spec_num_drafts)
    yield counter("pagedllm:spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
    yield counter("pagedllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
    per_pos = CounterMetricFamily("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft (0 = first).",
                                  labels=["model_name", "position"])
    for position, n in enumerate(s.spec_accepted_per_position):
        per_pos.add_metric([model, str(position)], n)
    yield per_pos
    yield gauge("pagedllm:spec_decode_acceptance_rate", "Accepted / verified draft tokens since start.",
                s.spec_acceptance_rate)
    yield gauge("pagedllm:spec_decode_mean_accepted_length", "Drafts accepted per verification since start.",
                s.spec_mean_accepted_length)


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.model = engine.model_name
        self.registry.register(_EngineStatsCollector(engine))  # type: ignore[arg-type]
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.requests = Counter(
            "pagedllm:request_success", "Requests finished, by finish reason.", [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedllm:inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        engine.finished_listeners.append(self.observe)

    def observe(self, out: RequestOutput) -> None:
        """Record one finished (or aborted) request."""
        m = self.model
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.requests.labels(m, c.finish_reason or "abort").inc()
        metrics = out.metrics
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.labels(m).observe(metrics.ttft)
        times = metrics.token_times
        for a, b in zip(times, times[1:]):
            self.itl.labels(m).observe(b - a)
        if metrics.finished_time is not None:
            self.e2e.labels(m).observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        return text + _VLLM_NAMES.sub(rb"\1vllm:", text)


# A metric name at the start of a sample line or after `# HELP ` / `# TYPE `; label values are left alone.
_VLLM_NAMES = re.compile(rb"^((?:# (?:HELP|TYPE) )?)pagedllm:", re.MULTILINE)
