"""The config reader (pagedllm.formats.model_config) against transformers' AutoConfig.

Every in-tree architecture's tiny config is read three ways -- as transformers 5 saves it (every field), as
its minimal form (only what differs from the class defaults, as hub files written by 4.x are) and bare
(model_type alone) -- plus hub-style files with the older spellings (`rope_theta` / `rope_scaling` beside
the fields, `torch_dtype`, Gemma 3's `rope_local_base_freq` / `sliding_window_pattern`, "auto" sizes), and
every field the engine reads must equal what transformers gives. Which fields those are is not a list kept by
hand: a recording config is what engines for every architecture read while they build and generate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.formats import hf_folder
from pagedllm.formats.architecture_defaults import KNOWN_MODEL_TYPES
from pagedllm.formats.model_config import ModelConfig, read_model_config
from pagedllm.testing.tiny import KINDS, save_tiny_model, tiny_hf_config

# What the engine read from the config while building and generating with every tiny architecture
# (test_engine_reads_only_checked_fields proves the list covers it), and the fields the loaders hand on.
ENGINE_FIELDS = sorted({
    "architectures", "attention_bias", "attention_chunk_size", "attn_layer_indices", "attn_logit_softcapping",
    "bos_token_id", "chunk_size", "conv_kernel", "dtype", "eos_token_id", "expand", "final_logit_softcapping", "head_dim",
    "hidden_act", "hidden_activation", "hidden_size", "intermediate_size", "is_encoder_decoder",
    "layer_norm_epsilon", "layer_types",
    "layers_block_type", "mamba_chunk_size", "mamba_conv_bias", "mamba_d_conv", "mamba_d_head", "mamba_d_state",
    "mamba_expand", "mamba_n_groups", "mamba_n_heads", "mamba_proj_bias", "max_position_embeddings",
    "max_window_layers", "mlp_bias", "model_type", "n_groups", "num_attention_heads", "num_experts_per_tok",
    "num_heads", "num_hidden_layers", "num_key_value_heads", "num_local_experts", "pad_token_id",
    "partial_rotary_factor", "query_pre_attn_scalar", "rms_norm_eps", "rope_local_base_freq", "rope_parameters",
    "rope_scaling", "rope_theta", "sliding_window", "state_size", "swiglu_alpha", "swiglu_limit",
    "tie_word_embeddings", "time_step_limit", "time_step_rank", "torch_dtype", "use_bias",
    "use_bidirectional_attention", "use_conv_bias", "use_sliding_window", "vocab_size",
})
_MISSING = "<missing>"

# Hub-style config.json files (fields as the published checkpoints write them, sizes cut where irrelevant).
HUB_STYLE: dict[str, dict[str, Any]] = {
    "llama-3.1": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
                  "eos_token_id": [128001, 128008, 128009]},
    "llama-linear-type": {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0},
                          "torch_dtype": "float16"},
    "qwen2.5": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
                "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
                "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 21,
                "num_hidden_layers": 24, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                "rope_scaling": None},
    "qwen2-window": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
                     "max_window_layers": 2, "num_hidden_layers": 4},
    "qwen2-yarn": {"model_type": "qwen2", "rope_theta": 1e6,
                   "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "qwen3": {"model_type": "qwen3", "head_dim": 128, "rope_theta": 1000000, "sliding_window": None,
              "use_sliding_window": False, "torch_dtype": "bfloat16"},
    "mistral-7b-v0.3": {"model_type": "mistral", "sliding_window": None, "rope_theta": 1000000.0,
                        "torch_dtype": "bfloat16"},
    "mistral-nemo": {"model_type": "mistral", "head_dim": 128, "hidden_size": 5120, "num_attention_heads": 32},
    "gemma-2-9b": {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "head_dim": 256, "query_pre_attn_scalar": 256, "rope_theta": 10000.0, "sliding_window": 4096,
                   "num_hidden_layers": 42, "torch_dtype": "float32", "cache_implementation": "hybrid"},
    "gemma-3-1b": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                   "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                   "sliding_window": 512, "sliding_window_pattern": 6, "num_hidden_layers": 26,
                   "torch_dtype": "bfloat16", "final_logit_softcapping": None},
    "gemma-3-4b-text": {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "num_hidden_layers": 34,
                        "sliding_window": 1024},
    "gemma3-bidirectional": {"model_type": "gemma3_text", "use_bidirectional_attention": True,
                             "sliding_window": 512},
    "gpt-oss-20b": {"model_type": "gpt_oss", "rope_theta": 150000, "num_hidden_layers": 24,
                    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                                     "original_max_position_embeddings": 4096, "truncate": False},
                    "num_local_experts": 32, "experts_per_token": 4, "torch_dtype": "bfloat16",
                    "layer_types": ["sliding_attention", "full_attention"] * 12},
    "mamba-130m": {"model_type": "mamba", "hidden_size": 768, "time_step_rank": 48, "intermediate_size": 1536},
    "mamba-auto-rank": {"model_type": "mamba", "hidden_size": 100, "time_step_rank": "auto", "expand": 3},
    "mamba2-codestral": {"model_type": "mamba2", "time_step_limit": [0.0, {"__float__": "Infinity"}],
                         "chunk_size": 256, "n_groups": 8, "head_dim": 64, "num_heads": 128},
    "bamba-9b": {"model_type": "bamba", "attn_layer_indices": [9, 18, 27], "mamba_d_head": 64,
                 "rope_theta": 10000.0, "torch_dtype": "bfloat16", "partial_rotary_factor": 1.0},
    "bamba-auto-head": {"model_type": "bamba", "mamba_d_head": "auto", "time_step_limit": [0.0, 10.0]},
    "legacy-layer-names": {"model_type": "qwen3", "layer_types": ["attention", "full_attention"],
                           "num_hidden_layers": 2},
}


def _variants() -> list[tuple[str, dict[str, Any]]]:
    cases = []
    for kind in KINDS:
        config = tiny_hf_config(kind)
        cases.append((f"{kind}-saved", json.loads(config.to_json_string(use_diff=False))))
        cases.append((f"{kind}-minimal", json.loads(config.to_json_string(use_diff=True))))
        cases.append((f"{kind}-bare", {"model_type": config.model_type, "architectures": config.architectures}))
    return cases + list(HUB_STYLE.items())


def _same(a: Any, b: Any) -> bool:
    # transformers keeps a list from JSON where a tuple came from a class default; the engine only iterates.
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _write(folder: Path, raw: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


@pytest.mark.parametrize(("name", "raw"), _variants(), ids=[n for n, _ in _variants()])
def test_fields_equal_transformers(name: str, raw: dict[str, Any], tmp_path: Path) -> None:
    import transformers

    folder = _write(tmp_path / name, raw)
    theirs = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    ours = read_model_config(folder, json.loads((tmp_path / name / "config.json").read_text()))
    assert isinstance(ours, ModelConfig)
    wrong = {
        field: (getattr(ours, field, _MISSING), getattr(theirs, field, _MISSING))
        for field in ENGINE_FIELDS
        if not _same(getattr(ours, field, _MISSING), getattr(theirs, field, _MISSING))
    }
    assert not wrong, f"{name}: (ours, transformers) differ: {wrong}"


def test_every_in_tree_model_type_is_read_here() -> None:
    assert {tiny_hf_config(kind).model_type for kind in KINDS} <= KNOWN_MODEL_TYPES


class _Recording(ModelConfig):
    """A ModelConfig noting every field read (present or not) into `seen`."""

    seen: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            _Recording.seen.add(name)
        return super().__getattr__(name)


def test_engine_reads_only_checked_fields(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Build and generate with every architecture on a recording config: ENGINE_FIELDS covers every read."""
    real = hf_folder.read_model_config

    def recording(folder: str, raw: dict[str, Any]) -> Any:
        config = real(folder, raw)
        return _Recording(config.to_dict()) if isinstance(config, ModelConfig) else config

    monkeypatch.setattr(hf_folder, "read_model_config", recording)
    _Recording.seen = set()
    for kind in KINDS:
        llm = LLM(save_tiny_model(kind, tiny_root), num_kv_blocks=64, num_threads=1)
        out = llm.generate([{"prompt_token_ids": [1, 5, 7, 9]}], SamplingParams(temperature=0.0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        del llm
    assert "hidden_size" in _Recording.seen  # the recording saw the engine's reads at all
    unchecked = _Recording.seen - set(ENGINE_FIELDS)
    assert not unchecked, (
        f"the engine reads fields the parity test does not compare: {sorted(unchecked)}; add them to ENGINE_FIELDS "
        "(and their class defaults to pagedllm/formats/architecture_defaults.py where transformers has one)"
    )


def test_no_transformers_import_without_a_tokenizer(tiny_root: Path) -> None:
    """Build an engine for a folder with no tokenizer files and generate: transformers is never imported."""
    folder = save_tiny_model("llama", tiny_root)
    code = (
        "import sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        f"llm = LLM({folder!r}, num_kv_blocks=64)\n"
        "llm.generate([{'prompt_token_ids': [1, 5, 7]}], SamplingParams(temperature=0.0, max_tokens=2))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_unknown_model_type_goes_through_transformers(tmp_path: Path) -> None:
    import transformers

    raw = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}
    config = read_model_config(_write(tmp_path / "gpt2", raw), raw)
    assert isinstance(config, transformers.GPT2Config)
    assert config.hidden_size == 64  # transformers' attribute map, which only its class knows


@pytest.mark.parametrize(("field", "value"), [("hidden_size", "64"), ("rms_norm_eps", "small"),
                                              ("tie_word_embeddings", 1), ("num_hidden_layers", 2.5)])
def test_wrong_type_names_file_and_field(field: str, value: Any, tmp_path: Path) -> None:
    raw = {"model_type": "llama", field: value}
    folder = _write(tmp_path / "bad", raw)
    with pytest.raises(ValueError, match=rf"config\.json.*{field}"):
        read_model_config(folder, raw)


def test_config_pickles_and_copies() -> None:
    """Tensor-parallel ranks receive the config pickled; tools deep-copy it and adjust fields."""
    import copy
    import pickle

    import torch

    config = read_model_config("unused", {"model_type": "llama", "torch_dtype": "bfloat16"})
    assert pickle.loads(pickle.dumps(config)) == config
    changed = copy.deepcopy(config)
    changed.num_hidden_layers = 1
    assert changed.num_hidden_layers == 1 and config.num_hidden_layers == 32
    assert config.dtype is torch.bfloat16 and config.torch_dtype is torch.bfloat16
    assert getattr(config, "not_a_field", None) is None


@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer",
                                             "Qwen2Tokenizer", "LlamaTokenizer"])
def test_tokenizer_loads_without_autoconfig(tokenizer_class: str, tiny_root: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder whose tokenizer_config.json names its class: the tokenizer is the one AutoTokenizer gives
    on its own (class, ids, specials, chat template), and AutoConfig is never called for it."""
    import shutil

    import transformers

    from pagedllm.testing.structured_output import small_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(save_tiny_model("qwen2", tiny_root), folder)
    tokenizer = small_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": tokenizer_class}))
    expected = transformers.AutoTokenizer.from_pretrained(str(folder))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("AutoConfig.from_pretrained was called")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    info = hf_folder.read_model_info(str(folder))
    got = info.tokenizer
    text = "the quick brown fox, 42 {json} ü"
    chat = [{"role": "user", "content": text}]
    assert type(got) is type(expected)
    assert got(text).input_ids == expected(text).input_ids
    assert got.decode(got(text).input_ids) == expected.decode(expected(text).input_ids)
    assert (got.eos_token_id, got.bos_token_id, len(got)) == (expected.eos_token_id, expected.bos_token_id,
                                                              len(expected))
    assert got.apply_chat_template(chat, tokenize=False) == expected.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_config_equals_transformers_class(arch: str) -> None:
    """The GGUF loader's config (model_config_from_dict of the metadata's fields) reads as the transformers
    class it stands for, built from the same fields, would."""
    import torch
    import transformers

    from pagedllm.api.loading import model_config_from_dict
    from pagedllm.plugins.loaders.gguf.config import ARCHS

    spec = ARCHS[arch]
    fields: dict[str, Any] = dict(
        architectures=[spec.hf_architecture], vocab_size=384, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        dtype=torch.bfloat16,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    )
    if spec.takes_head_dim:
        fields["head_dim"] = 16
    for flag in spec.bias_flags:
        fields[flag] = True
    theirs = getattr(transformers, spec.config_class)(**json.loads(json.dumps(fields, default=str)) | {
        "dtype": torch.bfloat16})
    ours = model_config_from_dict({"model_type": spec.model_type, **fields})
    assert ours.model_type == theirs.model_type
    wrong = {f: (getattr(ours, f, _MISSING), getattr(theirs, f, _MISSING)) for f in ENGINE_FIELDS
             if not _same(getattr(ours, f, _MISSING), getattr(theirs, f, _MISSING))}
    assert not wrong, wrong


def test_config_from_dict_refuses_unknown_model_type() -> None:
    from pagedllm.api.loading import model_config_from_dict

    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        model_config_from_dict({"model_type": "gpt2"})
