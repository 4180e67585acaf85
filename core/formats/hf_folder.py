"""What a local Hugging Face model folder says about its model: config, tokenizer, eos ids, quantization.

Loaders share this (the hf loader reads the weights afterwards; the dummy loader fills random ones), so it
lives in the API rather than in either plugin.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.protocols.loader import LoadedModelInfo

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_model_info(model: str, tokenizer: str | None = None) -> LoadedModelInfo:
    """Config, tokenizer (when the folder has one), eos ids and quantization config of a local HF folder.

    Every loader that reads a Hugging Face folder needs these facts (the dummy loader needs only them).
    """
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model folder '{model}' does not exist")
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"'{config_path}' not found: a model folder needs config.json")
    raw = read_json(config_path)

    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"'{config_path}': transformers cannot read this config: {exc}") from exc

    return LoadedModelInfo(
        hf_config=hf_config,
        tokenizer=_load_tokenizer(tokenizer or model, explicit=tokenizer is not None),
        eos_token_ids=_eos_token_ids(model, raw),
        quantization_config=raw.get("quantization_config"),
        source=model,
    )


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"'{path}': not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"'{path}': expected a JSON object")
    return data


def _load_tokenizer(path: str, explicit: bool) -> Any | None:
    # A folder without tokenizer files is legal (weights-only checkpoints); an explicit tokenizer must load.
    if not explicit and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ValueError(f"tokenizer at '{path}' cannot be loaded: {exc}") from exc


def _eos_token_ids(model: str, raw_config: dict[str, Any]) -> list[int]:
    """generation_config.json's eos ids first (what chat models stop on), then config.json's."""
    ids: list[int] = []
    gen_path = os.path.join(model, "generation_config.json")
    sources = [read_json(gen_path).get("eos_token_id")] if os.path.isfile(gen_path) else []
    sources.append(raw_config.get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
