"""Hugging Face folder loader: config.json, an optional tokenizer, and safetensors (or .bin) weights.

Weights are streamed one tensor at a time into `module.load_weights`, so peak host memory stays near one
tensor (safetensors files are memory-mapped) rather than the whole checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.layers.weight_utils import WeightLoadError
from pagedllm.protocols.loader import LoadedModelInfo

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def read_model_info(model: str, tokenizer: str | None = None) -> LoadedModelInfo:
    """Config, tokenizer (when the folder has one), eos ids and quantization config of a local HF folder.

    Shared with the dummy loader, which needs the same facts but not the weights.
    """
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model folder '{model}' does not exist")
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"'{config_path}' not found: a model folder needs config.json")
    raw = _read_json(config_path)

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


def _read_json(path: str) -> dict[str, Any]:
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
    sources = [_read_json(gen_path).get("eos_token_id")] if os.path.isfile(gen_path) else []
    sources.append(raw_config.get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def weight_files(model: str) -> list[str]:
    """The checkpoint files to read, in order: safetensors (index or glob) first, then PyTorch .bin."""
    for index_name, suffix in ((_SAFETENSORS_INDEX, ".safetensors"), (_BIN_INDEX, ".bin")):
        index_path = os.path.join(model, index_name)
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightLoadError(f"'{index_path}': no weight_map")
            files = [os.path.join(model, f) for f in sorted(set(weight_map.values()))]
            for path in files:
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"'{path}' is listed in '{index_path}' but does not exist")
            return files
        # training_args.bin sits next to many fine-tuned checkpoints and holds no weights.
        found = sorted(
            f for f in os.listdir(model) if f.endswith(suffix) and not f.startswith("training_args")
        )
        if found:
            return [os.path.join(model, f) for f in found]
    raise FileNotFoundError(f"no *.safetensors or *.bin weight files in '{model}'")


def iterate_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from every file; a file that cannot be parsed raises naming it."""
    for path in files:
        if path.endswith(".safetensors"):
            yield from _iterate_safetensors(path)
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise WeightLoadError(f"'{path}': cannot read PyTorch checkpoint: {exc}") from exc
            yield from state.items()


def _iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError: bad header, truncated file, ...
        raise WeightLoadError(f"'{path}': corrupt or unreadable safetensors file: {exc}") from exc
    with handle as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            try:
                tensor = f.get_tensor(name)
            except Exception as exc:
                raise WeightLoadError(f"'{path}': tensor '{name}' cannot be read: {exc}") from exc
            yield name, tensor


class HFLoader:
    """Reads a local Hugging Face model folder (config.json + safetensors, sharded or not)."""

    def check(self, model: str) -> list[str]:
        """Reasons this loader cannot read `model` (empty list: it can)."""
        if not os.path.isdir(model):
            return [f"'{model}' is not a directory"]
        if not os.path.isfile(os.path.join(model, "config.json")):
            return [f"no config.json in '{model}'"]
        try:
            weight_files(model)
        except (FileNotFoundError, ValueError) as exc:
            return [str(exc)]
        return []

    def load_info(self, model: str, tokenizer: str | None = None) -> LoadedModelInfo:
        """Config, tokenizer and eos ids; errors name the path and what is wrong with it."""
        return read_model_info(model, tokenizer)

    def load_weights(self, module: torch.nn.Module, model: str, info: LoadedModelInfo) -> None:
        """Stream every checkpoint tensor into `module.load_weights`; raise naming the folder on a mismatch."""
        files = weight_files(model)
        try:
            module.load_weights(iterate_weights(files))  # type: ignore[operator]
        except WeightLoadError as exc:
            if model in str(exc):
                raise
            raise WeightLoadError(f"'{model}': {exc}") from exc
