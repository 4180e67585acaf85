"""An in-process OTLP/HTTP trace collector for the tests: decodes what an exporter sends with the official
protobuf messages (opentelemetry-proto), so the spans checked are the ones that crossed the wire; and the
checks every request trace must pass. No tests here."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

PHASES = ("queue", "prefill", "decode", "detokenize")  # the request span's children, in timeline order


@dataclass
class Collector:
    url: str  # the traces endpoint, http://127.0.0.1:PORT/v1/traces
    spans: list[Any] = field(default_factory=list)  # opentelemetry.proto.trace.v1.trace_pb2.Span
    resources: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(self, name: str, count: int = 1, timeout: float = 30.0) -> list[Any]:
        """The spans named `name`, once at least `count` have arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if s.name == name]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


def attributes(span: Any) -> dict[str, Any]:
    """A span's (or resource's) attributes as plain Python values."""
    out: dict[str, Any] = {}
    for kv in span.attributes:
        out[kv.key] = _value(kv.value)
    return out


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@contextmanager
def otlp_collector() -> Iterator[Collector]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    collector: Collector

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            request = ExportTraceServiceRequest.FromString(body)
            with collector.lock:
                for rs in request.resource_spans:
                    collector.resources.append(attributes(rs.resource))
                    for ss in rs.scope_spans:
                        collector.spans.extend(ss.spans)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    collector = Collector(f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield collector
    finally:
        server.shutdown()
        server.server_close()


def check_request_trace(collector: Collector, root: Any, max_tokens: int) -> dict[str, Any]:
    """The request span's children are the four phases, in timeline order inside it; returns its attributes."""
    children = {s.name: s for s in collector.spans if s.parent_span_id == root.span_id}
    assert sorted(children) == sorted(PHASES), children.keys()
    assert all(c.trace_id == root.trace_id for c in children.values())
    q, p, d, t = (children[n] for n in PHASES)
    # arrival <= queued <= scheduled == prefill start; first token == prefill end == decode start
    assert root.start_time_unix_nano <= q.start_time_unix_nano <= q.end_time_unix_nano
    assert q.end_time_unix_nano == p.start_time_unix_nano < p.end_time_unix_nano
    assert p.end_time_unix_nano == d.start_time_unix_nano < d.end_time_unix_nano <= root.end_time_unix_nano
    assert d.start_time_unix_nano == t.start_time_unix_nano < t.end_time_unix_nano <= root.end_time_unix_nano
    attrs = attributes(root)
    assert attrs["gen_ai.usage.completion_tokens"] == max_tokens
    assert attrs["gen_ai.request.max_tokens"] == max_tokens
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    # vLLM's latency attributes agree with the spans' own extents (seconds vs nanoseconds).
    ns = 1e-9
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx((q.end_time_unix_nano - q.start_time_unix_nano) * ns, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
        (p.end_time_unix_nano - p.start_time_unix_nano) * ns, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        (d.end_time_unix_nano - d.start_time_unix_nano) * ns, abs=1e-6)
    assert attrs["gen_ai.latency.e2e"] == pytest.approx((root.end_time_unix_nano - root.start_time_unix_nano) * ns, abs=1e-6)
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    busy = attributes(t)["pagedllm.detokenize.busy_seconds"]
    assert 0 < busy <= (t.end_time_unix_nano - t.start_time_unix_nano) * ns
    return attrs
