"""examples/gpu/bench_online.py's CPU-side pieces: the 8B-vocabulary tokenizer, the prompts, the table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu" / "bench_online.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_online", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prepared(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> str:
    dest = str(tmp_path_factory.mktemp("online") / "model")
    bench.prepare(dest, tiny=True)
    return dest


def test_tokenizer_matches_the_8b_vocabulary(bench: ModuleType, prepared: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared)
    config = json.loads((Path(prepared) / "config.json").read_text())
    assert len(tok) == config["vocab_size"] == 128256
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"]) == (128000, 128001)
    # Every id the dummy model can sample has text: the detokenizer does its full work on each.
    backend = tok.backend_tokenizer
    for tid in range(0, 128256, 997):
        assert backend.decode([tid], skip_special_tokens=False) != ""
    text = "the quick brown fox"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_prompts_have_the_asked_length_and_share_prefixes(bench: ModuleType, prepared: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared)
    args = argparse.Namespace(seed=0, input_len=64, prefix_len=48, suffix_len=16, num_prefixes=2)
    rand = bench.prompt_texts(prepared, "random", 4, args)
    assert len(set(rand)) == 4 and all("\n" not in p for p in rand)
    assert all(60 <= len(tok.encode(p, add_special_tokens=False)) <= 68 for p in rand)
    pre = bench.prompt_texts(prepared, "prefix", 4, args)
    same, other = os.path.commonprefix([pre[0], pre[2]]), os.path.commonprefix([pre[0], pre[1]])
    assert len(same) > len(other) + 40  # requests 0 and 2 share prefix 0; request 1 has prefix 1


def _result(label: str, tok_s: float) -> dict[str, Any]:
    cell = {"loadgen": "vllm", "dataset": "random", "concurrency": 256, "output_throughput": tok_s,
            "p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "p50_itl_ms": 1.0, "p99_itl_ms": 2.0,
            "api_cpu_s_per_1k_tokens": 0.05}
    failed = {"loadgen": "vllm", "dataset": "prefix", "concurrency": 1, "error": "boom"}
    return {"label": label, "cells": [cell, failed]}


def test_table_rows_and_ratio(bench: ModuleType, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result("pagedllm", 1100.0)))
    b.write_text(json.dumps(_result("vllm", 1000.0)))
    lines = bench.table([str(a), str(b)]).splitlines()
    assert lines[0].startswith("| loadgen | prompts | conc | pagedllm out tok/s")
    assert lines[2].startswith("| vllm | random | 256 | 1,100 | 10.0 / 20.0 | 1.00 / 2.00 | 0.050 | 1,000 |")
    assert lines[2].endswith("| 1.100x |")
    assert lines[3].endswith("| - | - | - | - | - |")  # a failed cell: no figures, no ratio
