"""Tiny random Hugging Face checkpoints for tests, saved locally (no hub), cached per session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ["llama", "llama_tied", "qwen2", "qwen3"]


def tiny_config(kind: str) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # A wide init makes the random model's logits peaked, so greedy argmax is not decided by rounding.
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    if kind == "llama_tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500000.0)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    raise ValueError(kind)


def make_tiny_model(kind: str, root: Path, seed: int = 0) -> str:
    """Save a random model of `kind` under root/kind (once) and return the folder."""
    import transformers

    path = root / kind
    if (path / "config.json").exists():
        return str(path)
    torch.manual_seed(seed)
    config = tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' own greedy decode, one prompt at a time (no padding effects): (tokens, per-step logprobs)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
            results.append((tokens, logprobs))
    return results
