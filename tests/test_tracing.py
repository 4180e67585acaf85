"""OpenTelemetry tracing of requests (`observability.otlp_traces_endpoint`, vLLM's --otlp-traces-endpoint): the
spans reach an in-process OTLP/HTTP collector through the SDK's real exporter and are decoded with the official
protobuf messages; their names, nesting, order and vLLM's gen_ai.* attributes are checked."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_collector import Collector, attributes, check_request_trace, otlp_collector
from tiny_models import make_tiny_model

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collector]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with otlp_collector() as c:
        yield c


def test_offline_engine_exports_request_spans(tiny_root: Path, collector: Collector) -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from pagedllm import LLM, SamplingParams

    llm = LLM(make_tiny_model("llama", tiny_root), num_threads=1, otlp_traces_endpoint=collector.url)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11, 12]}]
    llm.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=6, ignore_eos=True))
    llm.shutdown()  # flushes the batch processor
    roots = collector.wait_for("llm_request", 2)
    assert len(roots) == 2 and len({r.trace_id for r in roots}) == 2  # one trace per request
    for root in roots:
        assert root.kind == Span.SPAN_KIND_SERVER and not root.parent_span_id
        attrs = check_request_trace(collector, root, 6)
        assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)
        assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert attrs["gen_ai.response.model"].endswith("llama")
    assert sorted(attributes(r)["gen_ai.usage.prompt_tokens"] for r in roots) == [3, 5]
    assert collector.resources and collector.resources[0]["service.name"] == "pagedllm"


def test_nothing_opentelemetry_is_imported_without_an_endpoint(tiny_root: Path) -> None:
    # The SDK and the exporters, that is: FastAPI itself imports the OpenTelemetry API's context module.
    code = (
        "import sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        "import pagedllm.plugins.server.app, pagedllm.tracing\n"
        f"llm = LLM({make_tiny_model('llama', tiny_root)!r}, num_threads=1)\n"
        "llm.generate([{'prompt_token_ids': [5, 6]}], SamplingParams(max_tokens=2))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_missing_opentelemetry_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.tracing import TracingUnavailableError, make_request_tracer

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(TracingUnavailableError, match=r'otlp_traces_endpoint.*pip install "pagedllm\[tracing\]"'):
        make_request_tracer("http://127.0.0.1:1/v1/traces", "m")


def test_unknown_protocol_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.tracing import TracingUnavailableError, make_request_tracer

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(TracingUnavailableError, match="carrier-pigeon"):
        make_request_tracer("http://127.0.0.1:1/v1/traces", "m")


def test_grpc_is_the_default_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from pagedllm.tracing import TracingUnavailableError, make_request_tracer

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    if importlib.util.find_spec("grpc") is None:  # the test extra installs only the HTTP exporter
        with pytest.raises(TracingUnavailableError, match=r"OTLP grpc exporter is not installed.*http/protobuf"):
            make_request_tracer("http://127.0.0.1:1", "m")
        return
    from pagedllm.tracing import _span_exporter  # pagedllm[tracing] brings both exporters

    assert type(_span_exporter("http://127.0.0.1:1")).__module__.endswith("grpc.trace_exporter")


def test_serve_reports_an_unusable_exporter_in_one_line() -> None:
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="carrier-pigeon")
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "serve", "--otlp-traces-endpoint",
                          "http://127.0.0.1:1/v1/traces", "--port", "1"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 2, out.stderr
    assert "pagedllm: error: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='carrier-pigeon'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_failing_tracer_never_fails_the_request(tiny_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    from pagedllm import LLM, SamplingParams

    class Broken:
        def trace(self, *args: object) -> None:
            raise RuntimeError("collector exploded")

        def shutdown(self) -> None:
            pass

    llm = LLM(make_tiny_model("llama", tiny_root), num_threads=1)
    llm.engine.processor.tracer = Broken()  # type: ignore[assignment]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].finished
    assert "tracing request" in caplog.text and "collector exploded" in caplog.text
    llm.shutdown()
