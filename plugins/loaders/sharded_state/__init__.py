"""Registers the `sharded_state` loader and the `save-sharded-state` command: a checkpoint saved per
tensor-parallel rank (each rank's own slices, in the engine's parameter layout), so a rank reads only its
bytes and slices nothing at start-up (vLLM's ShardedStateLoader and save_sharded_state, same file names).

Light on purpose: the loader, the saver and torch load only when used.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from pagedllm.api import LoaderCheckContext, RegisterCommand, RegisterLoader, hookimpl

MANIFEST = "sharded_state.json"


def _load() -> Any:
    from pagedllm.plugins.loaders.sharded_state.loader import ShardedStateLoader

    return ShardedStateLoader


def _check(model: LoaderCheckContext) -> list[str]:
    if not os.path.isdir(model):
        return [f"'{model}' is not a directory"]
    if not os.path.isfile(os.path.join(model, MANIFEST)):
        return [f"no {MANIFEST} in '{model}' (not saved by `pagedllm save-sharded-state`)"]
    if not glob.glob(os.path.join(glob.escape(model), "model-rank-*-part-*.safetensors")):
        return [f"no model-rank-*-part-*.safetensors files in '{model}'"]
    return []


def _command() -> Any:
    from pagedllm.plugins.loaders.sharded_state import cli

    return cli


@hookimpl
def register_loaders(register: RegisterLoader) -> None:
    # Above `hf` (10): such a folder also has config.json and *.safetensors, which `hf` would misread.
    register("sharded_state", _load, priority=20, check=_check,
             description="per-rank shards saved by `pagedllm save-sharded-state` (no slicing at load)")


@hookimpl
def register_commands(register: RegisterCommand) -> None:
    register("save-sharded-state", _command,
             description="save a model's tensor-parallel shards, one set of files per rank")
