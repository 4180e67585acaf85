"""Prometheus metrics for /metrics (names follow vLLM's, with the `pagedllm:` prefix, and every one of them
exported again under vLLM's `vllm:` prefix, so dashboards and alerts written for vLLM work unchanged).

Three sources: the engine core's latest SchedulerStats (running/waiting, KV usage, prefix cache, preemptions)
and the KV-cache configuration (vLLM's cache_config_info), read at scrape time by a custom collector so they are
never stale by more than one core message; the final RequestOutput of every request (token counters, and
vLLM's per-request histograms: TTFT, inter-token, end-to-end, queue, prefill, decode, inference, time per
output token, prompt and generation tokens; their timeline is RequestMetrics'); and each engine-core step's
tokens (iteration_tokens_total). Each app owns its registry, so two apps in one process do not clash.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.api.engine import EngineDeadError, IterationStats, RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
# vLLM's: tokens in one engine step (up to a 16,384-token step budget).
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


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
        yield from _kv_connector_metrics(s, gauge, counter)


def _kv_connector_metrics(s: Any, gauge: Any, counter: Any) -> Iterator[Metric]:
    """The KV connector's counters (docs/plugins/kv_connector.md), when one is configured: hit tokens and
    bytes moved per tier are counters; what a tier holds or waits for now (`*_blocks`, `*_requests`) is a
    gauge, and so is each tier's hit rate (its hit tokens / prompt tokens looked up)."""
    for key, value in sorted(getattr(s, "kv_connector", {}).items()):
        name = f"pagedllm:kv_connector_{key}"
        if key.endswith(("_blocks", "_requests")):
            yield gauge(name, f"KV connector: {key.replace('_', ' ')} now.", value)
        else:
            yield counter(name, f"KV connector: {key.replace('_', ' ')} since start.", value)
    for tier, rate in sorted(getattr(s, "kv_connector_hit_rates", {}).items()):
        yield gauge(f"pagedllm:kv_connector_{tier}_hit_rate",
                    f"KV connector: prompt tokens served by the {tier} tier / prompt tokens looked up.", rate)


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


class _CacheConfigCollector:
    """vLLM's cache_config_info: value 1, the KV-cache settings as labels (num_gpu_blocks: the blocks the
    running core sized, on whatever device it runs; empty until a core is ready)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        kv = self.engine.config.kv_cache
        try:
            ready = self.engine.ready
        except EngineDeadError:  # not started yet
            ready = None
        labels = {
            "block_size": str(ready.block_size if ready is not None else kv.block_size),
            "num_gpu_blocks": str(ready.num_blocks) if ready is not None else "",
            "cache_dtype": str(kv.cache_dtype),
            "enable_prefix_caching": str(kv.enable_prefix_caching),
            "gpu_memory_utilization": str(kv.gpu_memory_utilization),
            "kv_cache_memory_gb": str(kv.memory_gb),
            "num_gpu_blocks_override": "" if kv.num_blocks is None else str(kv.num_blocks),
        }
        info = GaugeMetricFamily("pagedllm:cache_config_info", "Information of the KV-cache configuration.",
                                 labels=list(labels))
        info.add_metric(list(labels.values()), 1.0)
        yield info


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.model = engine.model_name
        self.registry.register(_EngineStatsCollector(engine))  # type: ignore[arg-type]
        self.registry.register(_CacheConfigCollector(engine))  # type: ignore[arg-type]
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

        def phase(name: str, doc: str, buckets: Any = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=r)

        self.queue_time = phase("request_queue_time_seconds", "Time in the WAITING phase (queued to scheduled).")
        self.prefill_time = phase("request_prefill_time_seconds", "Time in the PREFILL phase (scheduled to first token).")
        self.decode_time = phase("request_decode_time_seconds", "Time in the DECODE phase (first to last token).")
        self.inference_time = phase("request_inference_time_seconds",
                                    "Time in the RUNNING phase (scheduled to last token).")
        self.tpot = phase("request_time_per_output_token_seconds",
                          "Mean time per output token after the first, per request.", _ITL_BUCKETS)
        tokens = _token_buckets(engine.max_model_len)
        self.prompt_hist = phase("request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.generation_hist = phase("request_generation_tokens", "Tokens generated per finished request.", tokens)
        self.iteration_tokens = phase("iteration_tokens_total", "Tokens (prompts that finished prefill, plus "
                                      "generated tokens) per engine step.", _ITERATION_BUCKETS)
        engine.finished_listeners.append(self.observe)
        engine.iteration_listeners.append(self.observe_iteration)

    def observe(self, out: RequestOutput) -> None:
        """Record one finished (or aborted) request."""
        m = self.model
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.labels(m).inc(num_generated)
        for c in out.outputs:
            self.requests.labels(m, c.finish_reason or "abort").inc()
        self.prompt_hist.labels(m).observe(len(out.prompt_token_ids))
        self.generation_hist.labels(m).observe(num_generated)
        metrics = out.metrics
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.labels(m).observe(metrics.ttft)
        times = metrics.token_times
        for a, b in zip(times, times[1:]):
            self.itl.labels(m).observe(b - a)
        # Each interval only once both of its ends happened (an abort in the queue has no prefill time).
        for histogram, value in ((self.e2e, metrics.e2e_time), (self.queue_time, metrics.queue_time),
                                 (self.prefill_time, metrics.prefill_time), (self.decode_time, metrics.decode_time),
                                 (self.inference_time, metrics.inference_time),
                                 (self.tpot, metrics.time_per_output_token)):
            if value is not None:
                histogram.labels(m).observe(value)

    def observe_iteration(self, iteration: IterationStats) -> None:
        tokens = iteration.num_prompt_tokens + iteration.num_generation_tokens
        if tokens:  # a step that only advanced a prefill chunk delivered nothing to count yet
            self.iteration_tokens.labels(self.model).observe(tokens)

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        return text + _VLLM_NAMES.sub(rb"\1vllm:", text)


# A metric name at the start of a sample line or after `# HELP ` / `# TYPE `; label values are left alone.
_VLLM_NAMES = re.compile(rb"^((?:# (?:HELP|TYPE) )?)pagedllm:", re.MULTILINE)
