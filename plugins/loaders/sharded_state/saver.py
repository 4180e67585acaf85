"""Saves a model's tensor-parallel shards: each rank's model is built in this process in turn (its layers
slice that rank's part of the source checkpoint while loading), and its state dict written as
`model-rank-{rank}-part-{part}.safetensors` beside the source's config, tokenizer and generation files.

Tensors that share storage (a tied LM head and embedding) are written once per rank file set under the first
name; the loader fills the other name through the same storage (`state_dict` returns both names).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

MANIFEST_FORMAT = "pagedllm-sharded-state"
# Files of a Hugging Face folder a loader needs besides the weights (the engine's `hf` reader uses them).
_COPIED = (".json", ".model", ".txt", ".jinja", ".tiktoken")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def save_sharded_state(config: Mapping[str, Any], output: str, max_size: int = 5 * 2**30) -> list[str]:
    """Write every rank's shard of `config`'s model (an engine config dict) to `output`; returns the files.

    :param max_size: bytes per file at most (a tensor larger than that gets a file of its own).
    """
    import torch
    from safetensors.torch import save_file

    from pagedllm.api.engine import EngineConfig
    from pagedllm.api.loading import build_model_shard

    engine_config = EngineConfig.from_dict({**config, "device": config.get("device", "cpu")})
    if engine_config.quantization.method not in (None, "none"):
        raise ValueError(
            f"quantization.method {engine_config.quantization.method!r}: only dense weights "
            "can be saved per rank yet (quantized methods repack their weights after loading)"
        )
    tp_size = engine_config.parallel.tensor_parallel_size
    os.makedirs(output, exist_ok=True)
    written: list[str] = []
    source = ""
    for rank in range(tp_size):
        model, info = build_model_shard(engine_config, tp_rank=rank)
        if info.quantization_config:
            raise ValueError(
                f"'{info.source}' is a quantized checkpoint "
                f"({info.quantization_config.get('quant_method', '?')}); only dense weights can be saved per rank yet"
            )
        source = info.source
        part: dict[str, torch.Tensor] = {}
        part_bytes, part_index = 0, 0
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            key = tensor.untyped_storage().data_ptr()
            if key in seen:
                continue  # shares storage with a tensor already written (module docstring)
            seen.add(key)
            size = tensor.numel() * tensor.element_size()
            if part and part_bytes + size > max_size:
                written.append(_write(save_file, output, rank, part_index, part))
                part, part_bytes, part_index = {}, 0, part_index + 1
            part[name] = tensor.detach().to("cpu").contiguous()
            part_bytes += size
        written.append(_write(save_file, output, rank, part_index, part))
        del model
    _copy_model_files(source, output)
    with open(os.path.join(output, "sharded_state.json"), "w", encoding="utf-8") as f:
        json.dump({"format": MANIFEST_FORMAT, "version": 1, "tensor_parallel_size": tp_size,
                   "source": str(config.get("model")), "dtype": engine_config.dtype}, f, indent=2)
    return written


def _write(save_file: Any, output: str, rank: int, part: int, tensors: dict[str, Any]) -> str:
    path = os.path.join(output, f"model-rank-{rank}-part-{part}.safetensors")
    save_file(tensors, path)
    return path


def _copy_model_files(source: str, output: str) -> None:
    if not os.path.isdir(source):
        raise ValueError(f"the model must be a Hugging Face folder, got '{source}'")
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if (os.path.isfile(path) and name.endswith(_COPIED) and not name.endswith(_WEIGHT_SUFFIXES)
                and not name.endswith(".index.json")):
            shutil.copy2(path, os.path.join(output, name))
