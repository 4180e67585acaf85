"""Helpers shared by every layer's weight loading: attribute tagging, the default loader, the load loop.

A parameter learns how to load itself through attributes set when it is created:

- ``weight_loader(param, loaded_weight, shard_id=None)``: copies (the right slice of) a checkpoint tensor in;
- ``output_dim`` / ``input_dim``: which axis of the parameter is the layer's output / input axis, so a
  tensor-parallel layer knows which axis to slice (None: the parameter is not sharded along it).

`load_weights_by_name` is the loop every model's ``load_weights`` shares: it maps Hugging Face names to our
parameters (stacked q/k/v -> qkv_proj and so on), feeds each tensor to its parameter's loader, and refuses to
finish while any parameter -- or any shard of a stacked parameter -- is still unloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

# (our parameter name part, the checkpoint's name part, shard id passed to weight_loader)
StackedMapping = list[tuple[str, str, int | str]]


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: a missing, unexpected, malformed or mis-shaped tensor."""


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (weight_loader, output_dim, input_dim, ...) to a parameter."""
    for key, value in attrs.items():
        # Never silently replace a loader: a layer overriding its method's loader must do so on purpose.
        if key != "weight_loader" and hasattr(param, key):
            raise AttributeError(f"parameter already has attribute '{key}'")
        setattr(param, key, value)


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; a remainder means a size cannot be split across tensor-parallel ranks."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator} (tensor-parallel size)")
    return numerator // denominator


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) after checking the shapes match (copy_ would broadcast a wrong shape silently)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightLoadError(
            f"shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}"
        )
    dst.copy_(src)  # also casts the checkpoint dtype (e.g. bf16) to the parameter dtype and moves devices


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole, unsharded tensor (replicated layers, norms)."""
    if shard_id is not None:
        raise WeightLoadError(f"a replicated parameter takes no shard id (got {shard_id!r})")
    copy_checked(param.data, loaded_weight)


def process_weights_after_loading(module: torch.nn.Module) -> None:
    """Give every quantized/linear layer its one chance to repack weights once all are loaded."""
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(sub)


def load_weights_by_name(
    module: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping,
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load Hugging Face-named tensors into `module`'s parameters; return the names of loaded parameters.

    `stacked` maps checkpoint sub-names onto fused parameters, e.g. ("qkv_proj", "q_proj", "q"). Tensors for
    which `skip(name)` is true are ignored (rotary inv_freq buffers, a tied lm_head). Raises WeightLoadError
    naming the tensor for an unexpected name or a bad shape, and naming every parameter (or shard) that no
    checkpoint tensor filled.
    """
    params = dict(module.named_parameters())
    # Which shards each stacked parameter still waits for; a plain parameter waits for shard None.
    expected: dict[str, set[int | str | None]] = {name: {None} for name in params}
    for param_part, _ckpt_part, stacked_id in stacked:
        for name in params:
            if f".{param_part}." in f".{name}":
                expected[name].discard(None)
                expected[name].add(stacked_id)
    received: dict[str, set[int | str | None]] = {name: set() for name in params}

    for ckpt_name, tensor in weights:
        if skip(ckpt_name):
            continue
        name, shard_id = _map_name(ckpt_name, stacked, params)
        param = params.get(name)
        if param is None:
            raise WeightLoadError(f"checkpoint tensor '{ckpt_name}' matches no model parameter")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except WeightLoadError as exc:
            raise WeightLoadError(f"checkpoint tensor '{ckpt_name}' -> parameter '{name}': {exc}") from exc
        received[name].add(shard_id)

    missing = [
        _checkpoint_name(name, shard, stacked)
        for name, shards in expected.items()
        for shard in sorted(shards - received[name], key=str)
    ]
    if missing:
        raise WeightLoadError(f"checkpoint lacks {len(missing)} tensor(s): {', '.join(missing)}")
    process_weights_after_loading(module)
    return set(params)


def _map_name(
    ckpt_name: str, stacked: StackedMapping, params: dict[str, torch.nn.Parameter]
) -> tuple[str, int | str | None]:
    """Checkpoint name -> (our parameter name, shard id) through the stacked mapping."""
    for param_part, ckpt_part, shard_id in stacked:
        if f".{ckpt_part}." in ckpt_name:
            candidate = ckpt_name.replace(f".{ckpt_part}.", f".{param_part}.")
            # A model may keep some projections unfused; only map when the fused parameter exists.
            if candidate in params:
                return candidate, shard_id
    return ckpt_name, None


def _checkpoint_name(name: str, shard_id: int | str | None, stacked: StackedMapping) -> str:
    """The checkpoint tensor that would have filled parameter `name` (shard `shard_id`), for error messages."""
    for param_part, ckpt_part, sid in stacked:
        if sid == shard_id and f".{param_part}." in name:
            return name.replace(f".{param_part}.", f".{ckpt_part}.")
    return name
