"""Tiny random Hugging Face checkpoints: configs small enough for CPU tests, saved to a local folder.

Sizes are the in-tree tests' (tests/tiny_models.py): two layers, hidden 64, GQA 4:2. A wide weight init makes a
random model's logits peaked, so greedy argmax is decided by the weights, not by float rounding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

KINDS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss", "mamba", "mamba2", "bamba")

_COMMON: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_hf_config(kind: str) -> Any:
    """A transformers config of `kind` (one of KINDS) at test size, its `architectures` set."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if kind == "qwen2":
        return transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    if kind == "qwen3":
        # head_dim != hidden / heads and tied embeddings, as in Qwen3-0.6B.
        return transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True,
                                        architectures=["Qwen3ForCausalLM"])
    if kind == "mistral":
        return transformers.MistralConfig(**_COMMON, head_dim=16, sliding_window=8,
                                          architectures=["MistralForCausalLM"])
    if kind == "gemma2":
        # Local and global layers (window 8, shorter than the check's longest prompt) and both soft-caps,
        # small enough that a missing cap changes the tokens. Gemma scales the embedding by sqrt(hidden), so
        # a narrower init keeps its logits from saturating into one repeated token.
        common = {**_COMMON, "initializer_range": 0.05, "num_hidden_layers": 4}
        return transformers.Gemma2Config(
            **common, head_dim=16, pad_token_id=0, sliding_window=8, query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0, final_logit_softcapping=10.0, architectures=["Gemma2ForCausalLM"],
        )
    if kind == "gemma3":
        # Gemma 3 text: local layers (window 8) with their own RoPE base around a global layer with a
        # linearly scaled RoPE, as in Gemma 3 4B+; q/k norms; a final soft-cap.
        common = {**_COMMON, "initializer_range": 0.05, "num_hidden_layers": 4}
        return transformers.Gemma3TextConfig(
            **common, head_dim=16, pad_token_id=0, sliding_window=8, query_pre_attn_scalar=16,
            final_logit_softcapping=10.0, architectures=["Gemma3ForCausalLM"],
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        )
    if kind == "gpt_oss":
        # Sliding (window 8) and full layers, 4 experts of which 2 per token, YaRN over a 128-token original
        # context; the learned sinks start random (transformers' init), attention and experts biased.
        common = {**_COMMON, "initializer_range": 0.2, "num_hidden_layers": 4, "intermediate_size": 32}
        return transformers.GptOssConfig(
            **common, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            tie_word_embeddings=False, architectures=["GptOssForCausalLM"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
        )
    ssm = {"vocab_size": _COMMON["vocab_size"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "mamba":
        return transformers.MambaConfig(**ssm, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4,
                                        expand=2, time_step_rank=8, architectures=["MambaForCausalLM"])
    if kind == "mamba2":
        # 8 heads of 8 channels in 2 B/C groups; chunk 8 < the longer prompts, so the SSD crosses chunks.
        return transformers.Mamba2Config(**ssm, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4,
                                         expand=2, num_heads=8, head_dim=8, n_groups=2, chunk_size=8,
                                         architectures=["Mamba2ForCausalLM"])
    if kind == "bamba":
        # Mamba-2 layers around one attention layer: two KV-cache groups (a state and paged blocks).
        return transformers.BambaConfig(
            **ssm, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[1],
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["BambaForCausalLM"],
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(KINDS)}")


def build_hf_model(config: Any, seed: int = 0, perturb_norms: float = 0.0) -> Any:
    """transformers' model for `config` with seeded random float32 weights, eager attention, in eval mode.

    `perturb_norms` adds N(0, value) noise to every norm weight: they start at a constant (1, or 0 for
    Gemma's 1 + w), and a constant scale would hide a model that reads the wrong norm weight, or none.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    if perturb_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name and param.dim() == 1:
                    param.add_(torch.randn_like(param) * perturb_norms)
    return model.eval()


def save_hf_model(model: Any, folder: str | os.PathLike[str], architectures: list[str] | None = None) -> str:
    """`save_pretrained` (safetensors) into `folder`; `architectures` overrides the one written.

    save_pretrained writes the transformers class name as `architectures`; a plugin registering another
    name for the same layout (the engine selects the model class by that name) needs its own written back.
    """
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    if architectures is not None:
        config_file = path / "config.json"
        data = json.loads(config_file.read_text())
        data["architectures"] = list(architectures)
        config_file.write_text(json.dumps(data, indent=2))
    return str(path)


def save_tiny_model(kind: str, root: str | os.PathLike[str], seed: int = 0) -> str:
    """A tiny random checkpoint of `kind` saved under root/kind (reused when already there); its folder."""
    path = Path(root) / kind
    if (path / "config.json").exists():
        return str(path)
    return save_hf_model(build_hf_model(tiny_hf_config(kind), seed), path)
