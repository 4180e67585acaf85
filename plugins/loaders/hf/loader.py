"""Hugging Face folder loader: config.json, an optional tokenizer, and safetensors (or .bin) weights.

Weights are streamed one tensor at a time into `module.load_weights`, so peak host memory stays near one
tensor (safetensors files are memory-mapped) rather than the whole checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from pagedllm.api.loading import LoadedModelInfo, WeightLoadError, read_json, read_model_info

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def weight_files(model: str) -> list[str]:
    """The checkpoint files to read, in order: safetensors (index or glob) first, then PyTorch .bin."""
    for index_name, suffix in ((_SAFETENSORS_INDEX, ".safetensors"), (_BIN_INDEX, ".bin")):
        index_path = os.path.join(model, index_name)
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map")
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
