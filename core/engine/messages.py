"""Plain messages between the scheduler, the model runner and the frontend (serialisable by design)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.request import EngineCoreEvent
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch-free at run time: the bitmask's module imports torch
    from pagedllm.structured_output.bitmask import DeferredBitmask, GrammarBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    # An encoder-decoder model's encoder prompt (Request.encoder_prompt_token_ids); None for decoder-only.
    encoder_prompt_token_ids: list[int] | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds; only what changed since the last step."""

    req_id: str
    new_block_ids: list[list[int]]  # per KV-cache group, blocks appended this step
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended (or were preempted) since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: the draft tokens scheduled for verification, per request (counted in
    # num_scheduled_tokens, after the request's known tokens). Requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: the token masks of the grammar requests that sample this step, filled by the engine
    # core after schedule() (structured_output/manager.py); None when the step has none (the runner skips it).
    structured_output: GrammarBitmask | None = None
    # A pipelined step's masks instead: filled by the runner once the step before's ids are in (manager.py
    # NOTE 3).
    deferred_structured_output: DeferredBitmask | None = None
    # A KV connector's plan for this step (saves of evicted blocks, loads of tier hits), run by the runner before
    # the forward (protocols/kv_connector.py); None when no connector is configured.
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsEntry:
    """Logprobs for one sampled token: the sampled id first, then the top-N (ids, logprobs, ranks)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request: the tokens sampled this step (empty while a prompt is still being prefilled).
    sampled_token_ids: list[list[int]]
    # One entry per request: None, or one LogprobsEntry per sampled token (several when drafts were accepted).
    logprobs: list[list[LogprobsEntry] | None]
    # Speculative decoding: per request, the draft tokens proposed for the next step (empty: none). Empty
    # list when speculation is off.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Prompt logprobs computed this step, for requests that asked: req_id -> (first prompt position the
    # entries describe, one entry per position: the actual prompt token first, then the top-N).
    prompt_logprobs: dict[str, tuple[int, list[LogprobsEntry]]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # Prompt logprobs of positions [prompt_logprobs_start, + len): worker/prompt_logprobs.py.
    new_prompt_logprobs: list[LogprobsEntry] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    # What happened to the request in the core since its last output (queued, scheduled, preempted); None: nothing.
    events: list[EngineCoreEvent] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
