"""The proposer protocol: what a speculative-decoding plugin implements, and how the engine builds one.

A proposer guesses the next tokens of each running request after every step. The engine schedules them with
the request's next token, the target scores all of them in one forward pass, and rejection sampling
(pagedllm.sample.rejection_sampler) keeps what the target would have produced, so a proposer changes speed,
never the output distribution. It runs in the engine-core process, inside the model runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pagedllm.plugin_spec import PluginKind
from pagedllm.sampling_params import SamplingParams
from pagedllm.selector import Selection, select

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, SpeculativeConfig
    from pagedllm.plugin_manager import PluginManager


@dataclass
class ProposerContext:
    """What a proposer's constructor gets: its config section and the target engine's facts."""

    config: SpeculativeConfig
    engine_config: EngineConfig
    plugin_manager: PluginManager
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # the target's; proposal distributions must be this wide
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # the target's KV blocks (a draft model's own cache may be sized from it)


@dataclass
class ProposalRequest:
    """One request to guess for.

    `token_ids` are its verified tokens (prompt and output); the last one is not yet in the target's KV
    cache. Propose at most `max_drafts` (>= 1) tokens to follow them.
    """

    req_id: str
    token_ids: list[int]
    max_drafts: int
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the request's own (seeded requests), for sampled proposals


@dataclass
class Proposals:
    """Per request, in the order asked: the draft ids, and the distribution q each was drawn from.

    `probs[i]` is [len(token_ids[i]), vocab_size] float32 on the engine's device, or None for a
    deterministic proposal (q one-hot on the draft; n-gram lookup). An empty list proposes nothing.
    """

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None]


class Proposer(Protocol):
    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        """Guess up to `max_drafts` tokens for each request (called once per step, after sampling)."""
        ...

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget requests that finished or were preempted (free whatever state they hold)."""
        ...


def build_proposer(ctx: ProposerContext) -> tuple[Any, Selection]:
    """Select the proposer named by `speculative.method` and build it with `ctx` (the target engine's facts)."""
    spec = ctx.config
    assert spec.method is not None
    selection = select(
        ctx.plugin_manager, PluginKind.PROPOSER, spec, requested=spec.method, requested_by="speculative.method"
    )
    return selection.load()(ctx), selection
