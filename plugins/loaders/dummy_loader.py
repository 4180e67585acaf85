"""Dummy loader: the real config (and tokenizer, if present) with random weights, for benchmarks.

Weights are small (uniform in [-1e-3, 1e-3]) so activations stay finite through many layers, and drawn from
a fixed seed so two runs of a benchmark see the same numbers.
"""

from __future__ import annotations

import torch

from pagedllm.layers.weight_utils import process_weights_after_loading
from pagedllm.plugins.loaders.hf_loader import read_model_info
from pagedllm.protocols.loader import LoadedModelInfo

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
        """Fill parameters in name order from a seeded generator on each parameter's device."""
        generators: dict[torch.device, torch.Generator] = {}
        for _name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            if not param.is_floating_point():
                continue  # packed integer tensors of a quantized method: leave to that method
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(self.seed)
            with torch.no_grad():
                param.uniform_(_LOW, _HIGH, generator=gen)
        process_weights_after_loading(module)
