"""A model runner's step on one pipeline stage (parallel_state.py NOTE 4; vLLM's PP model runner path).

Every stage runs the same step: the same SchedulerOutput, the same request states and the same input
layout, so each knows the step's token count T without being told. Per step:

    first stage             embed input ids -> its layers -> send (hidden, residual) [T, H] each
    middle stage            receive (hidden, residual) -> its layers -> send
    last stage              receive -> its layers -> final norm -> logits -> sample (the runner as usual)

A stage before the last has no logits: each of its requests that would sample records a PLACEHOLDER output
token (so its lengths, positions and block use stay in step), and the next step's message carries the
last stage's sampled ids, which replace the placeholders before that step runs (tp_worker.py NOTE 4).
The first stage's embedding therefore only ever reads real token ids: a placeholder left behind would be an
out-of-range index, a loud failure rather than a wrong token.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.communication import pp_recv, pp_send
from pagedllm.engine.messages import ModelRunnerOutput
from pagedllm.worker.request_state import CachedRequestState

PLACEHOLDER = -1  # an output token sampled elsewhere: on another stage, or by the step in flight (model_runner)


def stage_forward(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn_metadata: Any,
    kv_caches: list[torch.Tensor],
    pp_rank: int,
    pp_size: int,
) -> torch.Tensor | None:
    """This stage's share of the forward; the final hidden states on the last stage, None elsewhere (sent on)."""
    intermediate = None
    if pp_rank > 0:
        intermediate = model.make_empty_intermediate_tensors(int(input_ids.shape[0]))
        pp_recv(intermediate.tensors())
    out = model(input_ids, positions, attn_metadata, kv_caches, intermediate_tensors=intermediate)
    if pp_rank < pp_size - 1:
        pp_send(out.tensors())
        return None
    return out  # type: ignore[no-any-return]


def stage_step_output(
    req_ids: list[str], states: list[CachedRequestState], num_sched: list[int]
) -> ModelRunnerOutput:
    """A stage before the last finishes its step: placeholders where the last stage samples, no tokens."""
    for state, n in zip(states, num_sched, strict=True):
        if state.num_computed_tokens + n >= state.num_tokens:
            state.append_output(PLACEHOLDER)
        state.num_computed_tokens += n
    return ModelRunnerOutput(req_ids, [[] for _ in req_ids], [None] * len(req_ids))
