"""The model shapes the GPU side-by-side runs (`bench_suite.py --shape`, the anchor's `bench_vllm.py --shape`).

One table both engines read, so the two halves of a side-by-side cannot build different models. Each entry is a
config.json as its publisher ships it on the Hugging Face hub (the URL beside it), except the default, which is
the anchor's own Llama-3.1-8B shape (no rope scaling, 8,192 positions) kept key for key so that every earlier
8B figure stays comparable. Weights are dummy on both sides; only the shape matters.

Prompt ids are drawn uniformly from [ID_LOW, id_high(shape)): the anchor's [1000, 120000) wherever the
vocabulary allows it (the default's ids stay bit-identical), else up to 100 below the vocabulary's end.

Standard library only: the anchor imports this file before vLLM and torch.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

DEFAULT_SHAPE = "llama-3.1-8b"
ID_LOW = 1000
ANCHOR_ID_HIGH = 120000  # the anchor's upper bound (exclusive), from before shapes existed

SHAPES: dict[str, dict[str, Any]] = {
    # The anchor's dict (../shared/anchors/vllm/common.py LLAMA_8B_CONFIG), unchanged.
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
        "initializer_range": 0.02, "use_cache": True,
    },
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (q/k/v biases are Qwen2's, not a config key;
    # the 131,072-token window is off: use_sliding_window false)
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
        "use_sliding_window": False, "vocab_size": 152064,
    },
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json (tied embeddings, llama3 rope scaling)
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    # https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json (q/k RMSNorm; 32 x 128 query width != hidden 2560)
    "qwen3-4b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
        "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    # https://huggingface.co/google/gemma-2-2b/blob/main/config.json (head dim 256, soft-capping, local/global
    # layers; the checkpoint says float32, both engines are told bfloat16)
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
    },
    # https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json (the 8B's layers, a 32,768 vocabulary)
    "mistral-7b-v0.3": {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768,
    },
}


def shape_config(shape: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A fresh copy of `shape`'s config.json with `overrides` applied; an unknown name lists the known ones."""
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = copy.deepcopy(SHAPES[shape])
    cfg.update(overrides or {})
    return cfg


def id_high(shape: str) -> int:
    """The exclusive upper bound of prompt ids for `shape`: the anchor's 120,000, or 100 below a smaller
    vocabulary's end (the top ids of some vocabularies are special or padding rows)."""
    return min(ANCHOR_ID_HIGH, int(shape_config(shape)["vocab_size"]) - 100)


def default_model_dir(shape: str, suffix: str = "") -> str:
    """Where a side writes the config folder: the 8B's historical path, else one per shape (one config.json
    per folder, so two shapes in one machine session never read each other's)."""
    stem = "/tmp/llama31_8b_dummy" if shape == DEFAULT_SHAPE else f"/tmp/{shape}_dummy"
    return stem + suffix


def write_config(model_dir: str, shape: str = DEFAULT_SHAPE, overrides: dict[str, Any] | None = None) -> str:
    """Write `shape`'s config.json (with `overrides`) into model_dir and return the folder."""
    cfg = shape_config(shape, overrides)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return model_dir


# The quantization_config real checkpoints of each format carry (AutoGPTQ v1 symmetric; AutoAWQ GEMM): both
# sides write it into the config folder, so vLLM builds its Marlin layers (gptq_marlin, awq_marlin on sm_80+)
# and pagedllm its W4A16 ones over dummy packed weights of the same shapes.
CHECKPOINT_QUANTIZATION: dict[str, dict[str, Any]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}
# Methods that quantize a bf16 checkpoint while it loads: no quantization_config, the engine is told instead
# (vLLM `LLM(quantization="fp8")`: e4m3 weights, dynamic activation scales; pagedllm `quantization.method`).
ON_THE_FLY_QUANTIZATION = ("fp8",)
SIDE_BY_SIDE_QUANTIZATION = (*CHECKPOINT_QUANTIZATION, *ON_THE_FLY_QUANTIZATION)


def result_suffix(shape: str, quantization: str | None = None) -> str:
    """Appended to result and log names: empty for the default shape in bf16, so the 8B's file names stay as they
    were; another shape adds `_SHAPE`, a quantization `_METHOD`."""
    return ("" if shape == DEFAULT_SHAPE else f"_{shape}") + (f"_{quantization}" if quantization else "")
