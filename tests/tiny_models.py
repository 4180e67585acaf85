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
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' forward pass, greedy, one prompt at a time: (tokens, per-step logprobs)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy_with(model, p, max_new_tokens) for p in prompts]


def hf_greedy_with(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """A plain argmax loop over full forward passes, with no logits processors and no cache API: generate()'s
    min_new_tokens would mask EOS and change the argmax, which is not what ignore_eos means."""
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    logprobs = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, use_cache=False)
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(lp)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, torch.stack(logprobs)


def hf_greedy_cached(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """hf_greedy_with's argmax loop on transformers' own KV cache, the last position's logits only: the same
    tokens (log-probs within 1e-4 in float32) at a fraction of the cost for a real-sized model, whose
    full-forward loop re-reads the whole sequence every step."""
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    logprobs = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(lp)
            ids = torch.tensor([[token]])
    return tokens, torch.stack(logprobs)
