"""Request: the engine core's record of one sequence, from admission to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Holding blocks a KV connector fills in the background; outside the batch until they arrive (vLLM's
    # name; sched/base.py `park_for_external_load`).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the engine core (vLLM V1's EngineCoreEvent types)."""

    QUEUED = 1  # entered the engine core (a grammar still compiling counts as queue time, as in vLLM)
    SCHEDULED = 2  # sent to the model runner: its first admission, or a re-admission after a preemption
    PREEMPTED = 3  # its KV blocks were freed; it waits to be recomputed


@dataclass
class EngineCoreEvent:
    """One event with the core's `time.monotonic()` stamp. The frontend compares it with its own monotonic
    stamps (arrival, first token): on Linux that clock is one per machine, shared by every process, so the
    server's engine-core process and its API process agree (a core on another host would not)."""

    type: EngineCoreEventType
    timestamp: float


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """One sequence inside the engine core.

    `num_computed_tokens` counts tokens whose KV is in the cache (or scheduled to be written this step);
    the scheduler's only job is to move it towards `num_tokens`. `block_hashes` holds the chained hash of
    every *full* block of `all_token_ids`, extended as tokens are appended (see kv_cache/hashing.py).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Mixed into the first block's hash (chaining carries it into every later one): different salts never share.
    cache_salt: str | None = None
    # An encoder-decoder model's encoder prompt (None for decoder-only models): the prompt_token_ids are then
    # the decoder's. The encoder runs on it in the request's first step; its cross-attention K/V fill blocks of
    # their own KV-cache group (kv_cache/spec.py CrossAttentionSpec), never counted in num_tokens.
    encoder_prompt_token_ids: list[int] | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    # Draft tokens a proposer guessed after the last step, verified by the next one (speculative decoding).
    # They are not part of the sequence: never hashed, never in all_token_ids; the scheduler schedules them
    # after the known tokens and drops the rejected ones after the step.
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling (engine_core.py NOTE 1): tokens sampled by a step still in flight. They count as
    # sequence positions to schedule (the runner feeds them from the device) but are not known yet.
    num_output_placeholders: int = 0
    # Queued / scheduled / preempted since the last output: handed out on the next EngineCoreOutput (the
    # frontend's queue, prefill and decode times and tracing spans come from them).
    events: list[EngineCoreEvent] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_encoder_tokens(self) -> int:
        """The encoder prompt's length (0 for a decoder-only model)."""
        return len(self.encoder_prompt_token_ids) if self.encoder_prompt_token_ids is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens, those sampled by a step in flight, and the draft tokens waiting to be verified."""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders
                + len(self.spec_token_ids))

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.monotonic()))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events not handed out yet (None when there are none), forgotten here."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
