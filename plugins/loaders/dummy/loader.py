"""Dummy loader: the real config (and tokenizer, if present) with random weights, for benchmarks.

Weights are small (uniform in [-1e-3, 1e-3]) so activations stay finite through many layers, and drawn from
a fixed seed so two runs of a benchmark see the same numbers.

A quantized config works the same way: the quantization method creates its parameters on the target device
(packed codes, zeros, scales, block placeholders) and this loader fills whatever was created, by dtype --
floating point: small uniform noise; integer: uniformly random over the dtype's range (every bit pattern of
a packed code word is a valid code). A parameter whose random bits would not be valid says how to fill it:

    dummy_fill(tensor, generator)   fills a tensor of the parameter's (tp=1) shape in place (GPTQ's g_idx:
                                    k // group_size; zero points: the format's midpoint)
    dummy_load(generator)           the method loads random contents itself (GGUF's block placeholders)

NOTE 1: with tensor parallelism a rank still draws every parameter's full (tp=1) tensor, in the tp=1 order,
and keeps its slice through the layer's own `weight_loader`: the same seed gives the same model at any
tensor_parallel_size (each rank does the whole draw, which costs time only at load).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.api.loading import LoadedModelInfo, read_model_info
from pagedllm.api.model import QKVParallelLinear, process_weights_after_loading

_LOW, _HIGH = -1e-3, 1e-3


class DummyLoader:
    """Config from a folder with config.json; every floating-point parameter filled with seeded noise."""

    def __init__(self, seed: int = 1234) -> None:
        self.seed = seed

    def check(self, model: str) -> list[str]:
        """Only ever chosen by name; reports what would stop it from reading the config."""
        try:
            read_model_info(model)
        except (FileNotFoundError, ValueError) as exc:
            return [str(exc)]
        return []

    def load_info(self, model: str, tokenizer: str | None = None) -> LoadedModelInfo:
        """Config, optional tokenizer and eos ids from the folder (no weights are read)."""
        return read_model_info(model, tokenizer)

    def load_weights(self, module: torch.nn.Module, model: str, info: LoadedModelInfo) -> None:
        """Fill parameters in name order from a seeded generator on each parameter's device.

        With tensor parallelism each rank draws the whole tp=1 tensor and keeps its shard (NOTE 1), so the
        weights, and the tokens, are the same whatever the tensor_parallel_size.
        """
        ctx = getattr(module, "ctx", None)
        if ctx is not None and getattr(ctx, "tp_size", 1) > 1:
            self._load_sharded(module, ctx)
        else:
            generators: dict[torch.device, torch.Generator] = {}
            for _name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
                gen = self._generator(generators, param.device)
                dummy_load = getattr(param, "dummy_load", None)
                with torch.no_grad():
                    if dummy_load is not None:
                        dummy_load(gen)
                    else:
                        fill_random(param.data, gen, getattr(param, "dummy_fill", None))
        process_weights_after_loading(module)

    def _generator(self, generators: dict[torch.device, torch.Generator], device: torch.device) -> torch.Generator:
        gen = generators.get(device)
        if gen is None:
            gen = generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def _load_sharded(self, module: torch.nn.Module, ctx: Any) -> None:
        """NOTE 1: a tp=1 twin of the model on the meta device gives every parameter's full shape (and each
        fused layer's piece sizes); the full tensor is drawn exactly as tp=1 draws it, cut into the
        checkpoint's pieces, and handed to this rank's `weight_loader`, which keeps the rank's slice."""
        twin_ctx = dataclasses.replace(ctx, tp_rank=0, tp_size=1, device=torch.device("meta"))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(ctx.dtype)
        try:
            with torch.device("meta"):
                twin = type(module)(twin_ctx)
        finally:
            torch.set_default_dtype(previous)
        params = dict(module.named_parameters())
        generators: dict[torch.device, torch.Generator] = {}
        for name, full_param in sorted(twin.named_parameters(), key=lambda item: item[0]):
            param = params[name]
            gen = self._generator(generators, param.device)
            dummy_load = getattr(param, "dummy_load", None)
            if dummy_load is not None:  # the method draws this rank's own contents (not a tp=1 slice)
                dummy_load(gen)
                continue
            full = torch.empty(full_param.shape, dtype=param.dtype, device=param.device)
            fill_random(full, gen, getattr(full_param, "dummy_fill", None))
            layer = twin.get_submodule(name.rpartition(".")[0])
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                if loader is None:  # replicated (norms): the whole tensor
                    param.copy_(full)
                    continue
                for shard_id, piece in _checkpoint_pieces(layer, full_param, full):
                    if shard_id is None:
                        loader(param, piece)
                    else:
                        loader(param, piece, shard_id)


def fill_random(tensor: torch.Tensor, generator: torch.Generator, dummy_fill: Any = None) -> None:
    """Seeded random contents for one parameter: its own `dummy_fill`, else by dtype (module docstring)."""
    with torch.no_grad():
        if dummy_fill is not None:
            dummy_fill(tensor, generator)
        elif tensor.is_floating_point():
            tensor.uniform_(_LOW, _HIGH, generator=generator)
        elif tensor.dtype == torch.bool:
            tensor.random_(0, 2, generator=generator)
        elif tensor.dtype == torch.int64:
            tensor.random_(generator=generator)  # [0, 2^63): the range's top is not representable as `to`
        else:
            info = torch.iinfo(tensor.dtype)
            tensor.random_(info.min, info.max + 1, generator=generator)


def _checkpoint_pieces(
    layer: torch.nn.Module, full_param: torch.Tensor, full: torch.Tensor
) -> list[tuple[Any, torch.Tensor]]:
    """A fused tp=1 parameter cut back into the tensors a checkpoint would hold, with their shard ids."""
    output_dim = getattr(full_param, "output_dim", None)
    sizes = getattr(layer, "output_partition_sizes", None)
    if output_dim is None or sizes is None or len(sizes) == 1:
        return [(None, full)]
    if getattr(full_param, "packed_dim", None) == output_dim:  # several outputs per element (AWQ's qweight)
        sizes = [size // full_param.pack_factor for size in sizes]  # type: ignore[attr-defined]
    ids: list[Any] = ["q", "k", "v"] if isinstance(layer, QKVParallelLinear) else list(range(len(sizes)))
    return list(zip(ids, full.split(sizes, dim=output_dim)))
