"""Loads a sharded-state checkpoint: each rank copies its own tensors into the parameters they came from.

The files hold a built model's state dict (the engine's names and layout: fused qkv / gate_up, the padded
vocabulary) for one rank, split into parts of at most `max_size` bytes. A rank checks that the checkpoint was
saved for its tensor-parallel size and that every one of its parameters and buffers is there with the shape
it has, then copies; nothing is sliced, renamed or fused at load.
"""

from __future__ import annotations

import glob
import os

import torch

from pagedllm.api.loading import LoadedModelInfo, WeightLoadError, read_json, read_model_info
from pagedllm.api.model import process_weights_after_loading
from pagedllm.plugins.loaders.sharded_state import MANIFEST


def rank_files(model: str, rank: int) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(model), f"model-rank-{rank}-part-*.safetensors")))


class ShardedStateLoader:
    def check(self, model: str) -> list[str]:
        from pagedllm.plugins.loaders.sharded_state import _check

        return _check(model)

    def load_info(self, model: str, tokenizer: str | None = None) -> LoadedModelInfo:
        return read_model_info(model, tokenizer)

    def load_weights(self, module: torch.nn.Module, model: str, info: LoadedModelInfo) -> None:
        """One rank (tensor_parallel_size 1); the engine calls load_shard, which knows the rank."""
        self.load_shard(module, model, info, 0, 1)

    def load_shard(self, module: torch.nn.Module, model: str, info: LoadedModelInfo, tp_rank: int, tp_size: int) -> None:
        from safetensors import safe_open

        manifest = read_json(os.path.join(model, MANIFEST))
        saved_tp = manifest.get("tensor_parallel_size")
        if saved_tp != tp_size:
            raise WeightLoadError(
                f"'{model}' was saved for tensor_parallel_size {saved_tp}, the engine runs {tp_size}; save it "
                f"again with `pagedllm save-sharded-state --tensor-parallel-size {tp_size}` (or run with {saved_tp})"
            )
        files = rank_files(model, tp_rank)
        if not files:
            raise WeightLoadError(f"'{model}': no model-rank-{tp_rank}-part-*.safetensors for rank {tp_rank}")
        targets = dict(module.state_dict(keep_vars=True))
        filled: set[str] = set()
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    target = targets.get(name)
                    if target is None:
                        raise WeightLoadError(f"'{path}': tensor '{name}' matches no parameter of this model")
                    tensor = f.get_tensor(name)
                    if tensor.shape != target.shape:
                        raise WeightLoadError(
                            f"'{path}': tensor '{name}' has shape {tuple(tensor.shape)}, the parameter "
                            f"{tuple(target.shape)} (saved from another model or engine configuration?)"
                        )
                    with torch.no_grad():
                        target.data.copy_(tensor)
                    filled.add(name)
        # A name whose tensor shares storage with a filled one (a tied LM head) was filled through it (saver.py).
        filled_storage = {targets[n].untyped_storage().data_ptr() for n in filled}
        missing = sorted(n for n in set(targets) - filled if targets[n].untyped_storage().data_ptr() not in filled_storage)
        if missing:
            raise WeightLoadError(f"'{model}' rank {tp_rank} lacks {len(missing)} tensor(s): {', '.join(missing[:8])}")
        process_weights_after_loading(module)
