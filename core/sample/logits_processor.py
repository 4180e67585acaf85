"""Logits processors: named plugins that edit a step's logits after the built-in token edits, before penalties.

Design (vLLM V1's, simplified): processors are *engine-level*. The config's `logits_processors: [name, ...]`
builds each one once per engine, with its validated `plugins.<name>` section; each step the sampler calls
every processor, in config order, on the whole batch's [B, V] float32 logits — vectorised, one call per
step, not one per request. A processor that acts on some requests only reads per-request arguments from
`SamplingParams.extra_args` (a dict; `batch.extra_args(i)` is row i's, `{}` when unset).

    raw logits ──► logprobs (reported) ──► allowed_token_ids, bad_words, logit_bias, min_tokens
               ──► logits processors ──► penalties ──► temperature ...

Logprobs stay those of the model's raw distribution (vLLM's default), so a processor's bans do not show up
as -inf logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsProcessorContext:
    """What a logits processor's constructor receives."""

    name: str
    config: Any  # the validated `plugins.<name>` section (the plugin's config_model instance, else a dict)
    vocab_size: int
    device: torch.device


@dataclass
class LogitsBatch:
    """One step's rows, in logits order, for processors that need per-request facts."""

    params: list[SamplingParams]
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]] = field(default_factory=list)

    def extra_args(self, row: int) -> dict[str, Any]:
        """Row's `SamplingParams.extra_args` ({} when the request set none)."""
        return dict(getattr(self.params[row], "extra_args", None) or {})


class LogitsProcessor(Protocol):
    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        """Return the edited [B, V] float32 logits (in place or new). Must not sync with the host per row."""
        ...


def apply_logits_processors(
    logits: torch.Tensor, processors: Sequence[LogitsProcessor], batch: LogitsBatch | None
) -> torch.Tensor:
    """Run every processor in order; a shape change is a plugin bug, caught here rather than in sampling."""
    if not processors or batch is None:
        return logits
    for proc in processors:
        out = proc.apply(logits, batch)
        if out.shape != logits.shape:
            raise RuntimeError(f"logits processor {type(proc).__name__} changed the logits' shape "
                               f"{tuple(logits.shape)} to {tuple(out.shape)}")
        logits = out
    return logits
