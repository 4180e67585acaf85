"""The GPU side-by-side's model shapes (examples/gpu/model_shapes.py, read by bench_suite.py and the vLLM anchor).

Checked against references nobody here wrote: each shape built by transformers has its publisher's parameter
count (the hub's safetensors total), and a narrowed copy of each, built by our engine through `LLM` on the CPU
(bench_suite.cpu_check, the function `--cpu-check` runs), holds the bytes transformers' model of the same
config.json holds. The default stays the anchor's 8B dict, key for key, and its prompt ids the anchor's draws.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

GPU_DIR = Path(__file__).resolve().parents[1] / "examples" / "gpu"

# The hub's parameter count of each checkpoint (safetensors metadata on its model page).
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,  # meta-llama/Llama-3.1-8B
    "qwen2.5-7b": 7_615_616_512,  # Qwen/Qwen2.5-7B
    "llama-3.2-1b": 1_235_814_400,  # meta-llama/Llama-3.2-1B
    "qwen3-4b": 4_022_468_096,  # Qwen/Qwen3-4B
    "gemma-2-2b": 2_614_341_888,  # google/gemma-2-2b
    "mistral-7b-v0.3": 7_248_023_552,  # mistralai/Mistral-7B-v0.3
}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, GPU_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # bench_suite imports model_shapes by name: both see the same module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shapes() -> ModuleType:
    return _load("model_shapes")


@pytest.fixture(scope="module")
def suite(shapes: ModuleType) -> ModuleType:
    saved = list(sys.path)
    try:
        return _load("bench_suite")
    finally:
        sys.path[:] = saved  # the script puts its folder first on sys.path to import model_shapes


def _hf_model(config: dict[str, Any]) -> Any:
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def test_the_table_covers_the_published_shapes(shapes: ModuleType) -> None:
    assert set(shapes.SHAPES) == set(PUBLISHED_PARAMETERS)
    assert shapes.DEFAULT_SHAPE == "llama-3.1-8b"


def test_default_is_the_anchor_8b_dict_key_for_key(shapes: ModuleType) -> None:
    # h200_check.py holds its own copy of the anchor's LLAMA_8B_CONFIG (made before shapes existed).
    sys.path.insert(0, str(GPU_DIR))
    try:
        from h200_check import LLAMA_8B_CONFIG
    finally:
        sys.path.remove(str(GPU_DIR))
    default = shapes.shape_config(shapes.DEFAULT_SHAPE)
    assert default == LLAMA_8B_CONFIG
    assert list(default) == list(LLAMA_8B_CONFIG)  # the same config.json bytes, key order included


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_each_shape_has_its_publishers_parameter_count(shapes: ModuleType, name: str) -> None:
    model = _hf_model(shapes.shape_config(name))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]
    assert type(model).__name__ == shapes.shape_config(name)["architectures"][0]


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_head_layout_is_consistent(shapes: ModuleType, name: str) -> None:
    cfg = shapes.shape_config(name)
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    assert heads % kv_heads == 0
    if "head_dim" not in cfg:  # the model derives it: hidden / heads must be exact
        assert hidden % heads == 0
    elif cfg["model_type"] == "llama":  # this checkpoint family's query width is the hidden size
        assert heads * cfg["head_dim"] == hidden


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_every_prompt_id_is_inside_the_vocabulary(shapes: ModuleType, suite: ModuleType, name: str) -> None:
    high = shapes.id_high(name)
    vocab = shapes.shape_config(name)["vocab_size"]
    # The anchor's W3 also sends each id + 1 (an unseen prompt): that must stay inside the vocabulary too.
    assert high > shapes.ID_LOW and high + 1 < vocab
    prompts = suite.make_prompts(high)
    drawn = [*prompts.values(), np.array(suite.w4_prompts(1000, high))]
    drawn += [np.array(p) for p in suite.w5_prompts(1000, high)[0]]
    assert max(int(a.max()) for a in drawn) < high
    assert min(int(a.min()) for a in drawn) >= shapes.ID_LOW


def test_default_prompts_are_the_anchors_draws(shapes: ModuleType, suite: ModuleType) -> None:
    assert shapes.id_high(shapes.DEFAULT_SHAPE) == 120000
    rng = np.random.default_rng(0)  # the anchor's order: W1, W2, W3, warm-up, ids in [1000, 120000)
    expected = {k: rng.integers(1000, 120000, size=size, dtype=np.int64)
                for k, size in (("W1", (1000, 1024)), ("W2", (500, 128)), ("W3", (6, 128)), ("warmup", (16, 256)))}
    prompts = suite.make_prompts(120000)
    assert all(np.array_equal(prompts[k], expected[k]) for k in expected)


def test_names_follow_the_shape_and_the_default_keeps_its_own(shapes: ModuleType, suite: ModuleType) -> None:
    args = suite.parse_args([])
    assert (args.shape, args.model_dir, Path(args.out).name) == (
        "llama-3.1-8b", "/tmp/llama31_8b_dummy_pagedllm", "pagedllm_suite.json")
    args = suite.parse_args(["--shape", "qwen2.5-7b"])
    assert (args.model_dir, Path(args.out).name) == ("/tmp/qwen2.5-7b_dummy_pagedllm", "pagedllm_suite_qwen2.5-7b.json")
    assert shapes.default_model_dir(shapes.DEFAULT_SHAPE) == "/tmp/llama31_8b_dummy"  # the anchor's folder
    with pytest.raises(SystemExit):
        suite.parse_args(["--shape", "llama-3.2-1B"])  # names are exact
    with pytest.raises(SystemExit):
        suite.parse_args(["--workloads", "W1,W6"])


def test_dry_run_writes_the_shape_config(suite: ModuleType, tmp_path: Path) -> None:
    args = suite.parse_args(["--shape", "mistral-7b-v0.3", "--model-dir", str(tmp_path / "m")])
    report = suite.dry_run(args, suite.make_prompts(32668))
    assert report["id_range"] == [1000, 32668] and report["largest_id_drawn"] < 32768
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["vocab_size"] == 32768 and written["architectures"] == ["MistralForCausalLM"]


def _narrowed(cfg: dict[str, Any]) -> dict[str, Any]:
    """The shape with 2 layers (Gemma 2: one local, one global), one KV head per group, widths cut by the
    group count and a 4,096-token vocabulary: its own structure (biases, tied head, head dim, norms,
    soft-capping) at a size a CPU test builds in a second."""
    groups = cfg["num_key_value_heads"]
    heads = cfg["num_attention_heads"] // groups
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    hidden = cfg["hidden_size"] // groups if "head_dim" in cfg else heads * head_dim
    return {"num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": 1, "hidden_size": hidden,
            "intermediate_size": cfg["intermediate_size"] // groups, "vocab_size": 4096}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMETERS))
def test_our_engine_builds_the_shape_with_transformers_bytes(shapes: ModuleType, suite: ModuleType, name: str,
                                                             tmp_path: Path) -> None:
    args = argparse.Namespace(shape=name, model_dir=str(tmp_path / "model"), quantization=None)
    res = suite.cpu_check(args, _narrowed(shapes.shape_config(name)))
    assert len(res["token_ids"]) == 2 and all(0 <= t < 4096 for t in res["token_ids"])
    reference = _hf_model(json.loads((Path(res["model_dir"]) / "config.json").read_text()))
    assert res["weight_bytes"] == 2 * sum(p.numel() for p in reference.parameters())  # bf16, a tied head once
    embed = reference.get_input_embeddings().weight
    untied = reference.get_output_embeddings().weight is not embed  # Gemma 2 ties by its config's default
    expected_read = res["weight_bytes"] - (2 * (embed.numel() - embed.shape[1]) if untied else 0)
    assert res["decode_read_bytes"] == expected_read


def test_the_table_names_the_shape_and_refuses_another_shapes_baseline(suite: ModuleType) -> None:
    ours = {"shape": "qwen3-4b", "startup_s": 20.0, "w3_limit_ms": 1.0, "w3_read_limit_ms": 1.0,
            "workloads": {"W1": {"total_tokens_per_s": 110.0}, "W3": {"tpot_ms_median": 2.0}}}
    same = {"shape": "qwen3-4b", "startup_s": 90.0,
            "workloads": {"W1": {"total_tokens_per_s": 100.0}, "W3": {"step_tpot_ms_median": 2.2}}}
    text = suite.table(ours, same)
    assert "| workload (qwen3-4b) |" in text and "1.100x" in text and "1.100x" in text.split("W3 (")[1]
    other = {**same, "shape": "llama-3.2-1b"}
    text = suite.table(ours, other)
    assert "ran llama-3.2-1b, not qwen3-4b" in text and "x |" not in text
    legacy = {k: v for k, v in same.items() if k != "shape"}  # JSONs from before --shape: the 8B
    assert "ran llama-3.1-8b, not qwen3-4b" in suite.table(ours, legacy)


def test_a_quantized_run_is_compared_with_vllms_run_of_the_same_format(shapes: ModuleType, suite: ModuleType) -> None:
    ours = {"shape": "llama-3.1-8b", "quantization": "gptq", "startup_s": 9.0, "w3_limit_ms": 1.0,
            "workloads": {"W1": {"total_tokens_per_s": 120.0}}}
    marlin = {"shape": "llama-3.1-8b", "quantization": "gptq", "quantization_resolved": "gptq_marlin",
              "startup_s": 90.0, "workloads": {"W1": {"total_tokens_per_s": 100.0}}}
    text = suite.table(ours, marlin)
    assert "| workload (llama-3.1-8b, gptq) |" in text and "1.200x" in text and "gptq_marlin" in text
    bf16 = {k: v for k, v in marlin.items() if not k.startswith("quantization")}
    assert "ran llama-3.1-8b in bf16, not llama-3.1-8b, gptq" in suite.table(ours, bf16)
    assert "x |" not in suite.table(ours, {**marlin, "quantization": "awq"})
    # Both sides name their files after the format, and write the same checkpoint config for it.
    args = suite.parse_args(["--quantization", "awq"])
    assert Path(args.out).name == "pagedllm_suite_awq.json" == f"pagedllm_suite{shapes.result_suffix(args.shape, 'awq')}.json"
    assert suite.checkpoint_quantization("awq") == shapes.CHECKPOINT_QUANTIZATION["awq"]
    assert suite.checkpoint_quantization("fp8") is None and "fp8" in shapes.SIDE_BY_SIDE_QUANTIZATION


def test_side_by_side_script_parses() -> None:
    script = GPU_DIR / "device" / "side_by_side.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
