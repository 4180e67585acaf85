"""An engine assembled from a YAML file: named plugins are used, bad keys and bad models fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import ConfigError
from pagedllm.selector import SelectionError


def test_yaml_assembles_engine_with_named_plugins(tiny_root: Path, tmp_path: Path) -> None:
    model_dir = make_tiny_model("qwen2", tiny_root)
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(
        f"""
model: {model_dir}
attention: {{backend: torch}}
loader: {{name: hf}}
scheduler: {{name: fcfs, max_num_seqs: 4, max_num_batched_tokens: 16}}
kv_cache: {{block_size: 8, num_blocks: 64, enable_prefix_caching: true}}
"""
    )
    llm = LLM(config=str(cfg))
    parts = llm.engine.parts
    assert parts.selections["attention"].winner.name == "torch"
    assert parts.selections["attention"].requested == "torch"
    assert parts.selections["loader"].winner.name == "hf"
    assert parts.selections["scheduler"].winner.name == "fcfs"
    assert parts.selections["model"].winner.name == "Qwen2ForCausalLM"
    assert parts.selections["kv_manager"].winner.name == "full_attention"
    assert parts.num_blocks == 64 and parts.block_size == 8
    assert llm.engine.config.scheduler.max_num_seqs == 4
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert "attention_backend: torch (requested by config" in parts.describe()
    assert "Qwen2ForCausalLM (requested by the checkpoint's architectures" in parts.describe()
    # The start-up report's phases (the CPU has no graph capture or warm-up) account for the build's time.
    assert list(parts.startup_phases) == ["model and weights", "KV cache sizing and allocation"]
    assert 0 < sum(parts.startup_phases.values()) <= parts.load_seconds
    assert "start-up: model and weights " in parts.describe()


def test_yaml_bad_key_names_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("scheduler:\n  max_num_seq: 4\n")
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seq: unknown key"):
        LLM(config=str(cfg))


def test_unknown_plugin_name_is_explained(tiny_root: Path) -> None:
    model_dir = make_tiny_model("llama", tiny_root)
    with pytest.raises(SelectionError, match="no attention_backend named 'flashy'.*available: .*torch"):
        LLM(model_dir, attention_backend="flashy")


def test_max_model_len_beyond_the_models_positions_is_refused_at_startup(tiny_root: Path) -> None:
    """Not an IndexError in the rotary table mid-request (the tiny Llama has 512 positions)."""
    model_dir = make_tiny_model("llama", tiny_root)
    with pytest.raises(ValueError, match="max_model_len 2048 is greater than the model's max_position_embeddings 512"):
        LLM(model_dir, max_model_len=2048)
    assert LLM(model_dir, max_model_len=512).engine.parts.max_model_len == 512


def test_missing_model_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(Exception, match=str(missing)):
        LLM(str(missing))


def test_corrupt_gguf_names_path_and_problem(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"NOTAGGUF" + b"\0" * 64)
    with pytest.raises(Exception, match="broken.gguf") as info:
        LLM(str(bad))
    assert "magic" in str(info.value).lower() or "gguf" in str(info.value).lower()


def test_corrupt_safetensors_names_path(tiny_root: Path, tmp_path: Path) -> None:
    import shutil

    src = Path(make_tiny_model("llama", tiny_root))
    dst = tmp_path / "corrupt"
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(Exception, match="model.safetensors"):
        LLM(str(dst))
