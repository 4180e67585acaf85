"""What a local Hugging Face model folder says about its model: config, tokenizer, eos ids, quantization.

Loaders share this (the hf loader reads the weights afterwards; the dummy loader fills random ones), so it
lives in the API rather than in either plugin.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.formats.model_config import ModelConfig, read_model_config
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
    hf_config = read_model_config(model, raw)
    return LoadedModelInfo(
        hf_config=hf_config,
        tokenizer=_load_tokenizer(tokenizer or model, explicit=tokenizer is not None,
                                  config=hf_config if tokenizer in (None, model) else None),
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


def _load_tokenizer(path: str, explicit: bool, config: Any = None) -> Any | None:
    """The folder's transformers tokenizer, or None when it has no tokenizer files (and none was asked for).

    NOTE: AutoTokenizer reads the model's config through AutoConfig to learn the model type, and that import
    is transformers' model-loading stack (1.3 s of CPU time of a 2.3 s tokenizer load). When
    tokenizer_config.json names its class and runs no remote code, the config only supplies the model type,
    the checkpoint name and `tokenizer_class`, which our ModelConfig has: it is handed over instead.
    """
    # A folder without tokenizer files is legal (weights-only checkpoints); an explicit tokenizer must load.
    if not explicit and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {}
    if isinstance(config, ModelConfig) and _names_its_class(path):
        kwargs["config"] = config
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as exc:
        raise ValueError(f"tokenizer at '{path}' cannot be loaded: {exc}") from exc


def _names_its_class(path: str) -> bool:
    """tokenizer_config.json names the tokenizer class and maps no remote code (auto_map)."""
    config_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return False
    tokenizer_config = read_json(config_path)
    return isinstance(tokenizer_config.get("tokenizer_class"), str) and "auto_map" not in tokenizer_config


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
