"""Model loader protocol: where config, tokenizer and weights come from (an HF folder, a GGUF file, dummy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedllm.plugin_spec import optional


@dataclass
class LoadedModelInfo:
    """What a loader tells the engine about a model before the weights are read.

    `hf_config` reads like a transformers PretrainedConfig (architectures, sizes, rope settings): for the
    model types the in-tree models serve it is a `ModelConfig` (pagedllm.api.loading: config.json with the
    class defaults filled in, read without importing transformers), else transformers' own. `tokenizer` is a
    transformers tokenizer or None when the loader has none (dummy weights with random token ids).
    """

    hf_config: Any
    tokenizer: Any | None
    # Token ids that end generation besides the tokenizer's eos (from generation_config.json / GGUF).
    eos_token_ids: list[int] = field(default_factory=list)
    # The quantization_config of the checkpoint, if any (a dict as in config.json).
    quantization_config: dict[str, Any] | None = None
    source: str = ""


class ModelLoader(Protocol):
    @optional
    def check(self, model: str) -> list[str]:
        """Reasons this loader cannot read `model` (empty list: it can).

        Optional: selection runs the registration's `check=` (light, before anything is loaded), never this.
        """
        ...

    def load_info(self, model: str, tokenizer: str | None = None) -> LoadedModelInfo:
        """Read the config and tokenizer. Errors name the path and what is wrong with it."""
        ...

    def load_weights(self, module: torch.nn.Module, model: str, info: LoadedModelInfo) -> None:
        """Fill the built model's parameters.

        File-backed loaders stream (name, tensor) pairs in Hugging Face naming
        (model.layers.0.self_attn.q_proj.weight ...) into `module.load_weights(...)` and raise, naming the
        path, when a weight is missing or malformed; `dummy` fills parameters with small random values.
        """
        ...

    @optional
    def load_shard(self, module: torch.nn.Module, model: str, info: LoadedModelInfo, tp_rank: int, tp_size: int) -> None:
        """Fill one tensor-parallel rank's model from a checkpoint saved per rank (already sharded).

        Optional: the engine calls it instead of `load_weights` when the loader has it, so a format that
        stores each rank's own tensors (the `sharded_state` loader) knows which rank's files to read. Without
        it, `load_weights` streams whole tensors and each layer takes its rank's slice.
        """
        ...
