"""`bench --plot`: the figures carry what a reader needs (titles, values, ratios, skipped engines, percentiles
equal to numpy's), and a missing matplotlib or an unknown file type fails before any benchmark runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedllm.cli.main import main
from pagedllm.plugins.commands.bench import plots

pytest.importorskip("matplotlib")

MACHINE = {"cpu": "Test CPU", "torch_threads": 2, "date": "2026-12-01T00:00:00+00:00"}


def _texts(fig: Any) -> str:
    return "\n".join(t.get_text() for t in fig.findobj(match=lambda o: hasattr(o, "get_text")))


def test_throughput_figure_has_values_ratios_and_skipped_engines() -> None:
    plt = plots.require_matplotlib("x.png")
    results = {"pagedllm": {"output_tok_per_s": 300.0, "total_tok_per_s": 900.0, "requests_per_s": 3.0},
               "transformers": {"output_tok_per_s": 120.0, "total_tok_per_s": 450.0, "requests_per_s": 1.2},
               "llama.cpp": {"skipped": "llama.cpp needs a GGUF model"}}
    report = {"results": results, "machine": MACHINE, "engine": {"model": "/models/Qwen2.5-0.5B/"},
              "workload": {"num_requests": 32, "prompt_tokens": 4096, "output_tokens": 2048}}
    fig = plots.throughput_figure(plt, report)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["output tokens / s", "total tokens / s", "requests / s"]
    for ax, key in zip(axes, ("output_tok_per_s", "total_tok_per_s", "requests_per_s")):
        assert [round(b.get_height(), 6) for b in ax.patches] == [results["pagedllm"][key], results["transformers"][key]]
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        ratio = results["pagedllm"][key] / results["transformers"][key]
        assert ticks == ["pagedllm", f"transformers\npagedllm is {ratio:.2f}x"]
    text = _texts(fig)
    assert "32 requests, 4,096 prompt + 2,048 output tokens, Qwen2.5-0.5B" in text
    assert "llama.cpp skipped: llama.cpp needs a GGUF model" in text and "Test CPU, 2 threads" in text
    assert "300.0" in text and "120.0" in text  # the values written on the bars
    plt.close(fig)


def test_latency_figure_marks_numpys_percentiles() -> None:
    plt = plots.require_matplotlib("x.png")
    rng = np.random.default_rng(0)
    samples = {"pagedllm": {"ttft_ms": list(rng.uniform(10, 20, 40)), "itl_ms": list(rng.uniform(1, 2, 400))},
               "transformers": {"ttft_ms": list(rng.uniform(30, 60, 40)), "itl_ms": list(rng.uniform(3, 5, 400))}}
    results = {"pagedllm": {"decode_tok_per_s": 600.0}, "transformers": {"decode_tok_per_s": 250.0}}
    report = {"results": results, "machine": MACHINE, "engine": {"model": "m"},
              "workload": {"batch_size": 4, "input_len": 32, "output_len": 128, "num_iters": 10}}
    fig = plots.latency_figure(plt, samples, report)
    ttft_ax, itl_ax, bars = fig.axes
    for ax, key in ((ttft_ax, "ttft_ms"), (itl_ax, "itl_ms")):
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        for line, name in zip(legend, samples):
            p50, p90 = np.percentile(samples[name][key], [50, 90])
            assert line == f"{name}: p50 {p50:,.1f}, p90 {p90:,.1f} ms (n={len(samples[name][key])})"
    assert [t.get_text() for t in bars.get_xticklabels()] == ["pagedllm", "transformers\npagedllm is 2.40x"]
    assert "batch 4, 32 prompt + 128 output tokens, 10 iterations" in _texts(fig)
    plt.close(fig)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tp.png"
    report = {"results": {"pagedllm": {"output_tok_per_s": 1.0}}, "machine": MACHINE, "workload": {}}
    plots.plot_throughput(str(path), report)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_fails_before_the_benchmark(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    # A model that does not exist: the plot check comes first, so the engine is never reached.
    argv = ["bench", "throughput", "--model", str(tmp_path / "absent"), "--plot", str(tmp_path / "x.png")]
    assert main(argv) == 2
    assert 'needs matplotlib, which is not installed: pip install "pagedllm[plot]"' in capsys.readouterr().err


def test_unknown_plot_format_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "latency", "--model", str(tmp_path / "absent"), "--plot", str(tmp_path / "x.gif")]
    assert main(argv) == 2
    assert "must end in .png, .svg, .pdf" in capsys.readouterr().err


def test_serve_figure_names_the_load() -> None:
    plt = plots.require_matplotlib("x.png")
    samples = {"ttft_ms": [20.0, 30.0, 40.0], "itl_ms": [5.0, 6.0, 7.0, 8.0], "e2e_ms": [100.0, 120.0, 150.0]}
    summary = {"config": {"model": "smollm2", "num_prompts": 3, "request_rate": None, "input_len": 8,
                          "output_len": 4, "endpoint": "completions", "base_url": "http://127.0.0.1:8000"},
               "completed": 3, "failed": 0, "duration_s": 1.5, "request_throughput": 2.0, "output_throughput": 8.0}
    fig = plots.serve_figure(plt, samples, summary)
    assert [ax.get_title() for ax in fig.axes] == ["time to first token (per request)",
                                                   "inter-token latency (per token)", "end-to-end latency (per request)"]
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert legend == ["smollm2: p50 120.0, p90 150.0 ms (n=3)"]  # nearest rank, as serve_load's table
    from pagedllm.plugins.commands.bench.serve_load import _pcts

    table = _pcts([x / 1e3 for x in samples["e2e_ms"]])  # the printed table's numbers agree with the legend's
    assert (table["p50"] * 1e3, table["p90"] * 1e3) == pytest.approx((120.0, 150.0))
    text = _texts(fig)
    assert "3 requests, all at once, 8 prompt words + 4 output tokens, completions at http://127.0.0.1:8000" in text
    assert "completed 3, failed 0 in 1.50 s: 2.00 req/s, 8.0 output tok/s" in text
    plt.close(fig)
