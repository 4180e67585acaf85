"""Observability of a live `pagedllm serve` on the embedded model (issue 33 item 4): request traces exported to
an in-process OTLP collector (--otlp-traces-endpoint), vLLM's histograms and cache_config_info on /metrics
moving with the requests the official `openai` client sends (read back with prometheus_client's parser), and
`pagedllm top --once` reading the same server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from otlp_collector import Collector, check_request_trace, otlp_collector
from test_server_support import LiveServer, live_server

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
pytestmark = pytest.mark.slow

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_time_per_output_token_seconds", "request_prompt_tokens",
              "request_generation_tokens", "iteration_tokens_total")


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with otlp_collector() as c:
        yield c


@pytest.fixture(scope="module")
def server(default_gguf: str, collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("observability")
    args = [default_gguf, "--served-model-name", "smollm2", "--max-model-len", "512", "--block-size", "16", "--otlp-traces-endpoint", collector.url]
    with pytest.MonkeyPatch.context() as mp:
        # The exporter the test extra installs, and batches sent every 100 ms instead of 5 s.
        mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        with live_server(args, str(root / "server.log")) as srv:
            yield srv


def scrape(server: LiveServer) -> dict[str, Any]:
    """/metrics through prometheus_client's parser: family name -> family (vllm: names only)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def sample(families: dict[str, Any], family: str, suffix: str) -> float:
    return sum(s.value for s in families[family].samples if s.name == family + suffix)


def test_request_trace_reaches_the_collector(server: LiveServer, collector: Collector) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    roots = collector.wait_for("llm_request", 1)
    assert roots, f"no trace arrived:\n{server.log()}"
    attrs = check_request_trace(collector, roots[-1], 5)
    assert attrs["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert attrs["gen_ai.response.model"] == "smollm2"
    assert attrs["gen_ai.request.temperature"] == 0.0


def test_trace_context_from_the_client_is_the_parent(server: LiveServer, collector: Collector) -> None:
    import openai

    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0.0,
                              extra_body={"ignore_eos": True},
                              extra_headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
    roots = collector.wait_for("llm_request", 2)
    linked = [r for r in roots if r.trace_id.hex() == trace_id]
    assert len(linked) == 1, [r.trace_id.hex() for r in roots]
    assert linked[0].parent_span_id.hex() == span_id
    check_request_trace(collector, linked[0], 3)


def test_histograms_and_cache_info_move_with_requests(server: LiveServer) -> None:
    import openai

    before = scrape(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    usages = []
    for prompt, n in (("The capital of France is", 4), ("One, two, three,", 7)):
        out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=n, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.usage is not None
        usages.append(out.usage)
    after = scrape(server)
    for name in HISTOGRAMS:
        family = f"vllm:{name}"
        assert after[family].type == "histogram", name
        grew = sample(after, family, "_count") - sample(before, family, "_count")
        expected = sum(u.completion_tokens - 1 for u in usages) if name == "inter_token_latency_seconds" else 2
        if name == "iteration_tokens_total":  # one observation per step that delivered tokens
            assert grew >= max(u.completion_tokens for u in usages), name
        else:
            assert grew == expected, name
    # Every prompt token is counted once (the step its prefill ended) and every generated token once.
    tokens = sum(u.prompt_tokens + u.completion_tokens for u in usages)
    assert sample(after, "vllm:iteration_tokens_total", "_sum") - sample(before, "vllm:iteration_tokens_total", "_sum") == tokens
    assert (sample(after, "vllm:request_generation_tokens", "_sum")
            - sample(before, "vllm:request_generation_tokens", "_sum")) == sum(u.completion_tokens for u in usages)
    assert (sample(after, "vllm:request_prompt_tokens", "_sum")
            - sample(before, "vllm:request_prompt_tokens", "_sum")) == sum(u.prompt_tokens for u in usages)
    # Phases add up: prefill + decode = inference, as sums over the same requests.
    grown = {n: sample(after, f"vllm:{n}", "_sum") - sample(before, f"vllm:{n}", "_sum") for n in HISTOGRAMS}
    assert grown["request_prefill_time_seconds"] + grown["request_decode_time_seconds"] == pytest.approx(
        grown["request_inference_time_seconds"], rel=1e-6)
    assert 0 < grown["request_inference_time_seconds"] < grown["e2e_request_latency_seconds"]
    info = after["vllm:cache_config_info"].samples
    assert len(info) == 1 and info[0].value == 1.0
    labels = info[0].labels
    assert labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "auto"


def run_top(server: LiveServer, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "top", "--url", server.url, "--once", *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def test_top_once_reads_the_server(server: LiveServer) -> None:
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=120).raise_for_status()
    families = scrape(server)
    out = run_top(server, "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["model"] == "smollm2" and figures["engine_healthy"] is True
    assert figures["generation_tokens"] == sample(families, "vllm:generation_tokens", "_total")
    assert figures["requests_finished"] == sample(families, "vllm:request_success", "_total") > 0
    assert figures["block_size"] == "16"
    ttft = figures["time_to_first_token_seconds"]
    assert ttft["count"] == sample(families, "vllm:time_to_first_token_seconds", "_count")
    assert ttft["mean"] == pytest.approx(sample(families, "vllm:time_to_first_token_seconds", "_sum") / ttft["count"])
    assert 0 < ttft["p50"] <= ttft["p99"]
    text = run_top(server)
    assert text.returncode == 0, text.stderr
    screen = text.stdout
    assert "model smollm2" in screen and "KV cache" in screen and "TTFT (ms)" in screen
    assert "\x1b[" not in screen  # --once draws no screen control


def test_top_names_an_unreachable_server() -> None:
    from test_server_support import free_port

    out = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "top", "--url", f"http://127.0.0.1:{free_port()}",
                          "--once"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "cannot reach" in out.stderr and "/metrics" in out.stderr


def test_bench_serve_plots_the_load(server: LiveServer, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "serve.png", tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "bench", "serve", "--base-url", server.url,
                          "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--plot", str(png),
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(out.read_text())
    assert summary["completed"] == 4 and "_samples" not in summary  # raw times go to the figure only
