"""OpenTelemetry spans of every finished request, exported over OTLP (vLLM's `--otlp-traces-endpoint`).

Off unless `observability.otlp_traces_endpoint` is set: then `make_request_tracer` imports the OpenTelemetry SDK
and the OTLP exporter (`pip install "pagedllm[tracing]"`); nothing here imports them otherwise. One trace per
request, written when it finishes from the stamps in its RequestMetrics (outputs.py draws them):

    llm_request  (SERVER)       arrival ─────────────────────────────────────────────── finished
      queue                              queued ── scheduled
      prefill                                      scheduled ── first token
      decode                                                    first token ── last token
      detokenize                                                first token ──── last detokenizer call

`llm_request` is a child of the caller's span when the HTTP request carried W3C trace context (`traceparent`,
`tracestate`), and carries vLLM's attributes under their names (gen_ai.request.*, gen_ai.usage.*,
gen_ai.latency.*: vllm/tracing/utils.py SpanAttributes), so dashboards built on vLLM's traces read ours. vLLM
stops there (one span); the child spans are ours, named after the phases. Detokenization happens a few tokens
at a time between decode steps, so its span covers the interval in which it ran and its attribute
`pagedllm.detokenize.busy_seconds` says how much of that interval it actually took.

The exporter follows OpenTelemetry's variables as vLLM does: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is `grpc`
(the default) or `http/protobuf`; the batching processor's OTEL_BSP_* variables set how often spans leave.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.config import ConfigError

if TYPE_CHECKING:
    from pagedllm.outputs import RequestOutput
    from pagedllm.sampling_params import SamplingParams

INSTALL_HINT = 'pip install "pagedllm[tracing]"'
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing/utils.py), the OpenTelemetry GenAI conventions where they exist."""

    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_FINISH_REASON = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


class TracingUnavailableError(ConfigError):
    """An OTLP endpoint is configured but the OpenTelemetry packages (or the protocol's exporter) are not
    installed: a usage error, which the CLI reports in one line."""


def make_request_tracer(endpoint: str | None, model_name: str) -> RequestTracer | None:
    """A tracer exporting to `endpoint`, or None when no endpoint is configured (nothing is imported then)."""
    if not endpoint:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailableError(
            f"observability.otlp_traces_endpoint ({endpoint}) needs OpenTelemetry, which is not installed "
            f"({exc.name}): {INSTALL_HINT}"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "pagedllm", "pagedllm.process_id": os.getpid()}))
    provider.add_span_processor(BatchSpanProcessor(_span_exporter(endpoint)))
    return RequestTracer(provider, model_name)


def _span_exporter(endpoint: str) -> Any:
    protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint, insecure=True)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            return HttpExporter(endpoint=endpoint)
    except ImportError as exc:
        raise TracingUnavailableError(
            f"the OTLP {protocol} exporter is not installed ({exc.name}): {INSTALL_HINT}, or set "
            f"{PROTOCOL_VARIABLE} to the other protocol (grpc, http/protobuf)"
        ) from exc
    raise TracingUnavailableError(f"{PROTOCOL_VARIABLE}={protocol!r}: use grpc or http/protobuf")


class RequestTracer:
    """Writes each finished request's spans (the module docstring); `provider` is an SDK TracerProvider."""

    def __init__(self, provider: Any, model_name: str) -> None:
        from opentelemetry.trace import SpanKind

        self.provider = provider
        self.model_name = model_name
        self._tracer = provider.get_tracer("pagedllm")
        self._server_kind = SpanKind.SERVER

    def trace(self, output: RequestOutput, params: SamplingParams | None, num_sequences: int,
              trace_headers: Mapping[str, str] | None = None) -> None:
        """Write one finished request's spans; `trace_headers` (W3C traceparent / tracestate from the HTTP
        request) make `llm_request` a child of the caller's span, as vLLM does."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        m = output.metrics
        if m is None:
            return
        # Monotonic stamps -> the epoch nanoseconds OpenTelemetry wants, with one offset for all of them.
        offset_ns = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset_ns

        end = m.finished_time if m.finished_time is not None else time.monotonic()
        attrs = _request_attributes(self.model_name, output, params, num_sequences)
        parent = TraceContextTextMapPropagator().extract(dict(trace_headers)) if trace_headers else None
        span = self._tracer.start_span("llm_request", context=parent, kind=self._server_kind,
                                       start_time=ns(m.arrival_time), attributes=attrs)
        ctx = trace.set_span_in_context(span)
        phases: list[tuple[str, float | None, float | None, dict[str, Any]]] = [
            ("queue", m.queued_time, m.scheduled_time, {}),
            ("prefill", m.scheduled_time, m.first_token_time,
             {SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
              SpanAttributes.GEN_AI_USAGE_CACHED_TOKENS: output.num_cached_tokens}),
            ("decode", m.first_token_time, m.last_token_time,
             {SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: len(m.token_times)}),
            ("detokenize", m.first_token_time, m.detokenized_time,
             {"pagedllm.detokenize.busy_seconds": m.detokenize_seconds}),
        ]
        for name, start, stop, extra in phases:
            if start is not None and stop is not None:
                self._tracer.start_span(name, context=ctx, start_time=ns(start), attributes=extra).end(ns(stop))
        span.end(ns(end))

    def shutdown(self) -> None:
        """Export what is still batched, then stop the exporter."""
        self.provider.shutdown()


def _request_attributes(model: str, output: RequestOutput, params: SamplingParams | None,
                        num_sequences: int) -> dict[str, Any]:
    m = output.metrics
    assert m is not None
    a = SpanAttributes
    attrs: dict[str, Any] = {
        a.GEN_AI_RESPONSE_MODEL: model,
        a.GEN_AI_REQUEST_ID: output.request_id,
        a.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
        a.GEN_AI_USAGE_COMPLETION_TOKENS: sum(len(c.token_ids) for c in output.outputs),
        a.GEN_AI_USAGE_CACHED_TOKENS: output.num_cached_tokens,
        a.GEN_AI_USAGE_NUM_SEQUENCES: num_sequences,
        a.GEN_AI_RESPONSE_FINISH_REASON: [c.finish_reason or "abort" for c in output.outputs],
        "pagedllm.num_preemptions": m.num_preemptions,
    }
    if params is not None:
        attrs[a.GEN_AI_REQUEST_TEMPERATURE] = params.temperature
        attrs[a.GEN_AI_REQUEST_TOP_P] = params.top_p
        attrs[a.GEN_AI_REQUEST_N] = params.n
        if params.max_tokens is not None:
            attrs[a.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
    for name, value in ((a.GEN_AI_LATENCY_TIME_IN_QUEUE, m.queue_time),
                        (a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, m.ttft),
                        (a.GEN_AI_LATENCY_E2E, m.e2e_time),
                        (a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, m.prefill_time),
                        (a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, m.decode_time),
                        (a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, m.inference_time)):
        if value is not None:
            attrs[name] = value
    return attrs
