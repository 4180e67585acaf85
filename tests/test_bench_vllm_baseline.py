"""`pagedllm bench ... --compare-vllm`: the subprocess protocol with vLLM's interpreter, without vLLM.

vLLM CPU lives in its own virtual environment and never in CI. These tests drive the real protocol -- the job
file, `vllm_runner.py` run by another interpreter, the result file, the token-count check -- with
interpreters that are not vLLM's: one without vLLM (the runner's import fails), one that dies before writing
anything, and our Python with tests/fake_vllm on its path (a toy engine with vLLM's offline surface that
decodes what it is asked and records what reached it). The GGUF -> HF folder conversion vLLM is given is
checked against transformers' own GGUF load.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from test_gguf_loader import tiny_hf_weights, write_tiny_gguf

from pagedllm.cli.main import main
from pagedllm.plugins.commands.bench.vllm_baseline import (
    PYTHON_ENV,
    BaselineSkipped,
    hf_folder_from_gguf,
    interpreter,
    vllm_env,
)

FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("vllm_gguf") / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_weights("llama"))
    return str(path)


@pytest.fixture(scope="module")
def interpreters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vllm_pythons")
    return {
        # A real Python without vLLM: the runner starts, its `import vllm` fails, it writes the error.
        "no_vllm": _script(root / "no_vllm", f'exec {sys.executable} -I "$@"'),
        # An interpreter that dies before the runner could write anything.
        "crash": _script(root / "crash", 'echo "fatal: this is no python" >&2; exit 3'),
        "fake": _script(root / "fake", f'PYTHONPATH={FAKE_VLLM} exec {sys.executable} "$@"'),
    }


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the dequantized folder, per test
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.jsonl"))


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]


def _throughput(model: str, out: Path, *extra: str) -> list[str]:
    return ["bench", "throughput", "--model", model, "--num-threads", "1", "--max-num-seqs", "4",
            "--num-prompts", "5", "--input-len-range", "3:12", "--output-len", "4", "--json", str(out),
            "--compare-vllm", *extra]


def test_without_vllm_the_baseline_is_skipped_with_its_reason_and_the_report_is_whole(
    tiny_gguf: str, interpreters: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "tp.json"
    assert main(_throughput(tiny_gguf, out, "--vllm-python", interpreters["no_vllm"])) == 0
    data = json.loads(out.read_text())
    reason = data["results"]["vLLM"]["skipped"]
    assert "No module named 'vllm'" in reason and interpreters["no_vllm"] in reason
    assert data["results"]["pagedllm"]["output_tok_per_s"] > 0 and data["workload"]["output_tokens"] == 20
    assert "pagedllm/vLLM" not in data["ratios"]
    # The processor's flags, as the engine's CPU defaults read them.
    features = data["machine"]["cpu_features"]
    assert features["logical_cpus"] >= 1 and isinstance(features["flags"], list) and features["summary"]


def test_an_interpreter_that_dies_is_reported_by_its_last_words(
    tiny_gguf: str, interpreters: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", tiny_gguf, "--num-threads", "1", "--input-len", "4", "--output-len", "3",
            "--num-iters", "1", "--json", str(out), "--compare-vllm", "--vllm-python", interpreters["crash"]]
    assert main(argv) == 0
    reason = json.loads(out.read_text())["results"]["vLLM"]["skipped"]
    assert "exit status 3" in reason and "fatal: this is no python" in reason


def test_no_interpreter_named_is_a_reason_that_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BaselineSkipped, match=PYTHON_ENV):
        interpreter(None)
    with pytest.raises(BaselineSkipped, match="not an executable"):
        interpreter("/nonexistent/python")
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    assert interpreter(None) == sys.executable


def test_throughput_against_the_fake_engine(tiny_gguf: str, interpreters: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    assert main(_throughput(tiny_gguf, out, "--vllm-python", interpreters["fake"])) == 0
    data = json.loads(out.read_text())
    row = data["results"]["vLLM"]
    assert "skipped" not in row, row
    assert row["num_requests"] == 5 and row["output_tok_per_s"] > 0 and row["startup_s"] >= 0
    assert row["total_tok_per_s"] * row["elapsed_s"] == pytest.approx(
        data["workload"]["prompt_tokens"] + data["workload"]["output_tokens"])
    assert row["versions"]["vllm"] == "0.0.0+fake" and row["dtype"] == "bfloat16"
    assert "dequantized to bfloat16" in row["weights"]  # while ours ran the file kept quantized
    assert data["results"]["pagedllm"]["weights"].endswith("(gguf loader, quantization gguf)")
    assert data["ratios"]["pagedllm/vLLM"]["output_tok_per_s"] > 0
    init, *calls = _records(tmp_path)
    # The engine settings and the environment it ran in: one bound core for --num-threads 1, our KV budget.
    assert init["env"]["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert int(init["env"]["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    assert init["kwargs"]["dtype"] == "bfloat16" and init["kwargs"]["skip_tokenizer_init"] is True
    assert init["kwargs"]["enable_prefix_caching"] == data["engine"]["enable_prefix_caching"]
    assert init["kwargs"]["max_model_len"] == data["engine"]["max_model_len"]
    # The model folder is an HF folder made from the GGUF, under the cache.
    assert init["model"].startswith(str(tmp_path / "cache" / "pagedllm" / "hf_from_gguf"))
    # A warm-up with fresh ids, then exactly the workload's prompts.
    warm, timed = (c["prompts"] for c in calls)
    assert sum(len(p) for p in timed) == data["workload"]["prompt_tokens"] and len(timed) == 5
    assert not set(map(tuple, warm)) & set(map(tuple, timed))


def test_a_baseline_that_makes_the_wrong_token_count_reports_no_numbers(
    tiny_gguf: str, interpreters: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")
    monkeypatch.setenv(PYTHON_ENV, interpreters["fake"])  # the default interpreter, from the environment
    out = tmp_path / "tp.json"
    assert main(_throughput(tiny_gguf, out, "--no-warmup")) == 0
    reason = json.loads(out.read_text())["results"]["vLLM"]["skipped"]
    assert "request 0 made 3 tokens, expected 4" in reason


def test_latency_against_the_fake_engine(tiny_gguf: str, interpreters: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", tiny_gguf, "--num-threads", "1", "--input-len", "5", "--output-len", "6",
            "--batch-size", "2", "--num-iters", "2", "--json", str(out), "--compare-vllm",
            "--vllm-python", interpreters["fake"], "--vllm-dtype", "float32"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    row = data["results"]["vLLM"]
    assert "skipped" not in row, row
    assert row["num_iters"] == 2 and row["dtype"] == "float32"
    assert row["ttft_ms_p50"] > 0 and row["tpot_ms_p50"] > 0 and row["output_tok_per_s"] > 0
    assert "tpot_ms_p50_speedup" in data["ratios"]["pagedllm/vLLM"]
    added = [r["prompt"] for r in _records(tmp_path) if r["event"] == "add_request"]
    assert len(added) == 4 and all(len(p) == 5 for p in added)  # 2 iterations x batch 2, stepped


def test_the_hf_folder_holds_the_ggufs_model_and_is_made_once(tiny_gguf: str, tmp_path: Path) -> None:
    import torch
    import transformers

    folder = hf_folder_from_gguf(tiny_gguf, "float32", cache_root=str(tmp_path))
    made = os.path.getmtime(Path(folder) / "model.safetensors")
    assert hf_folder_from_gguf(tiny_gguf, "float32", cache_root=str(tmp_path)) == folder
    assert os.path.getmtime(Path(folder) / "model.safetensors") == made
    assert json.loads((Path(folder) / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # The folder, read as a plain HF checkpoint, is transformers' own GGUF load of the file: the same logits.
    src, name = os.path.split(tiny_gguf)
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 200]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits)
    assert transformers.AutoTokenizer.from_pretrained(folder).encode("he w") == \
        transformers.AutoTokenizer.from_pretrained(src, gguf_file=name).encode("he w")


def test_vllm_env_binds_our_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    env = vllm_env(threads=1, kv_memory_gb=1.5)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "PYTHONPATH" not in env
