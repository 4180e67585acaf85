"""Hugging Face folder loader: config.json, an optional tokenizer, and safetensors (or PyTorch .bin / .pt)
weights, sharded with an index or not.

Weights are streamed one tensor at a time into `module.load_weights`, so peak host memory stays near one
tensor rather than the whole checkpoint: safetensors files and PyTorch zip checkpoints are memory-mapped.

NOTE (pickle): a PyTorch checkpoint is a pickle, and unpickling runs whatever code the file names. It is read
with `torch.load(weights_only=True)`, whose unpickler accepts only tensors, containers and plain values, so a
file carrying any other object is refused (naming the file and the object) and nothing in it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from pagedllm.api.loading import LoadedModelInfo, WeightLoadError, read_json, read_model_info

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Files next to many fine-tuned checkpoints that hold no weights (trainer, optimizer and scheduler state).
_NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state")


def weight_files(model: str) -> list[str]:
    """The checkpoint files to read, in order: safetensors (index or glob) first, then PyTorch .bin / .pt."""
    for index_name, suffixes in ((_SAFETENSORS_INDEX, (".safetensors",)), (_BIN_INDEX, _PICKLE_SUFFIXES)):
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
            f for f in os.listdir(model) if f.endswith(suffixes) and not f.startswith(_NOT_WEIGHTS)
        )
        if found:
            return [os.path.join(model, f) for f in found]
    raise FileNotFoundError(f"no *.safetensors, *.bin or *.pt weight files in '{model}'")


def iterate_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from every file; a file that cannot be parsed raises naming it."""
    for path in files:
        if path.endswith(".safetensors"):
            yield from _iterate_safetensors(path)
        else:
            yield from _iterate_pickle(path)


def _iterate_pickle(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A PyTorch checkpoint's tensors (module NOTE: weights_only, so nothing in the file runs)."""
    import pickle
    import zipfile

    # mmap needs the zip format torch.save has written since 1.6; older (legacy tar) files load whole.
    mmap = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise WeightLoadError(
            f"'{path}': refused: the checkpoint holds objects other than tensors, and pagedllm never unpickles "
            f"arbitrary objects (torch.load weights_only=True: {first}); convert it to safetensors"
        ) from None
    except Exception as exc:
        raise WeightLoadError(f"'{path}': cannot read PyTorch checkpoint: {exc}") from exc
    if isinstance(state, dict) and set(state) <= {"state_dict", "model"} and len(state) == 1:
        state = next(iter(state.values()))  # {"state_dict": {...}} / {"model": {...}}: training scripts' wrappers
    if not isinstance(state, dict):
        raise WeightLoadError(f"'{path}': expected a dict of tensors (a state dict), found {type(state).__name__}")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightLoadError(
                f"'{path}': entry {name!r} is {type(tensor).__name__}, not a tensor; a weights file holds a "
                "flat dict of tensors"
            )
        yield name, tensor


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
    """Reads a local Hugging Face model folder (config.json + safetensors or .bin / .pt, sharded or not)."""

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
