"""What a model needs to be split into pipeline stages (vLLM's PPMissingLayer / IntermediateTensors).

A stage builds only its own decoder layers (distributed/pp_partition.py says which); every other module
position holds a `PPMissingLayer`, which owns no parameters, so the stage's memory, its checkpoint reads
and its KV cache cover its layers alone. Between stages travel the `IntermediateTensors`: the hidden state
and the un-normalised residual stream, the two values a pre-norm decoder carries from layer to layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class PPMissingLayer(nn.Identity):
    """Stands where a module of another pipeline stage would be; calling it is a bug, so it raises."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("a module of another pipeline stage was called on this stage")


@dataclass
class IntermediateTensors:
    """A stage's output for the next stage: [T, hidden] hidden state and residual, T the step's tokens."""

    hidden: torch.Tensor
    residual: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden, self.residual]

    @classmethod
    def empty(cls, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        """Buffers a stage receives into (and the profiling step's stand-in input)."""
        def make() -> torch.Tensor:
            return torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)

        return cls(make(), make())


def pp_missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Dotted names (with a trailing dot) of the model's PPMissingLayer modules: checkpoint tensors under
    them belong to another stage and are skipped while loading."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))


def is_pp_missing(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether checkpoint tensor `name` belongs to another stage (`prefixes` from pp_missing_prefixes)."""
    return name.startswith(prefixes)
