"""Prompt logprobs: for requests that ask (`SamplingParams.prompt_logprobs=N`), the logprob of each prompt token
given the tokens before it, plus the top N, computed from the hidden states of the step's prompt chunk.

vLLM's semantics: the first prompt token has no logprob (nothing predicts it), so a prompt of P tokens gets
P - 1 entries, for positions 1..P-1. A chunk of the prompt scheduled this step (chunked prefill) yields the
entries its positions predict:

    prompt    t0   t1   t2   t3   t4   t5          P = 6
    chunk     [ c=2 ........ c+n=5 )               this step computes the hidden rows of t2, t3, t4
    predicts            t3   t4   t5               entries for positions 3, 4, 5 (start = c + 1)

The row of the last prompt token predicts the first *output* token: the sampler's job, not an entry here.
Such requests skip the prefix cache (kv_cache_manager.get_computed_blocks), as in vLLM, so every position
is computed at least once; a recompute after preemption yields the same positions again, which the output
processor writes over (entries carry their start position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.engine.messages import LogprobsEntry
from pagedllm.sample.sampler import LogprobsTensors, gather_logprobs
from pagedllm.worker.request_state import CachedRequestState

# Rows of logits made at once: a whole 2,048-token chunk at a 128k vocabulary would be a 1 GiB float32 block.
_ROWS_PER_SLICE = 256


class _HasLogits(Protocol):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class PromptLogprobsSlot:
    """One request's share of this step: hidden rows [row, row + count) predict prompt positions
    [start, start + count); `num` is the request's top-N."""

    req_id: str
    row: int
    start: int
    count: int
    num: int
    targets: list[int]  # the actual prompt tokens at those positions


def plan(req_ids: list[str], states: list[CachedRequestState], num_sched: list[int], wanted: set[str]
         ) -> list[PromptLogprobsSlot]:
    """The slots of the step's requests in `wanted`; call before num_computed_tokens moves on."""
    slots = []
    row = 0
    for rid, state, n in zip(req_ids, states, num_sched, strict=True):
        if rid in wanted:
            computed = state.num_computed_tokens
            last = len(state.prompt_token_ids) - 1  # the last prompt row predicts an output, not a prompt token
            count = min(computed + n, last) - computed
            if count > 0:
                num = state.sampling_params.prompt_logprobs
                assert num is not None
                prompt = state.prompt_token_ids
                slots.append(PromptLogprobsSlot(rid, row, computed + 1, count, num,
                                                prompt[computed + 1:computed + 1 + count]))
        row += n
    return slots


def compute(model: _HasLogits, hidden: torch.Tensor, slots: list[PromptLogprobsSlot], vocab_size: int
            ) -> dict[str, tuple[int, LogprobsTensors]]:
    """Per slot's request: (start position, logprobs of the raw distribution, column 0 = the actual token).

    Every tensor-parallel rank calls this with the same slots: the LM head's all-gather is a collective."""
    out: dict[str, tuple[int, LogprobsTensors]] = {}
    device = hidden.device
    for slot in slots:
        targets = torch.tensor(slot.targets, dtype=torch.int64, device=device)
        parts = []
        for lo in range(0, slot.count, _ROWS_PER_SLICE):
            hi = min(lo + _ROWS_PER_SLICE, slot.count)
            logits = model.compute_logits(hidden[slot.row + lo:slot.row + hi])
            logprobs = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
            parts.append(gather_logprobs(logprobs, slot.num, targets[lo:hi]))
        out[slot.req_id] = (slot.start, LogprobsTensors(
            token_ids=torch.cat([p.token_ids for p in parts]),
            logprobs=torch.cat([p.logprobs for p in parts]),
            ranks=torch.cat([p.ranks for p in parts]),
        ))
    return out


def to_entries(computed: dict[str, tuple[int, LogprobsTensors]]) -> dict[str, tuple[int, list[LogprobsEntry]]]:
    """Host entries, one per prompt position (a device->host copy per request)."""
    result = {}
    for rid, (start, tensors) in computed.items():
        n = tensors.token_ids.shape[1] - 1
        entries = tensors.to_entries([n] * tensors.token_ids.shape[0])
        result[rid] = (start, [e for e in entries if e is not None])
    return result
