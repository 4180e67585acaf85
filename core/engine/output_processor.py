"""OutputProcessor: engine-core token ids → RequestOutputs (text, logprobs, stop strings, n > 1, timing).

Lives on the frontend side, so detokenization never slows the engine loop. A stop string found here ends
the request: the processor reports which requests the engine core must abort.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.detokenizer import IncrementalDetokenizer
from pagedllm.engine.messages import EngineCoreOutput, LogprobsEntry
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from pagedllm.request import EngineCoreEvent, EngineCoreEventType
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # OpenTelemetry is imported only when a tracer is made (tracing.py)
    from pagedllm.tracing import RequestTracer

logger = logging.getLogger("pagedllm")


@dataclass
class _Sample:
    """One sequence (one of a request's n samples)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # What earlier DELTA outputs already carried (tokens, characters of text).
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, _Sample]  # engine-core id -> sample
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # [None] + one slot per later prompt position, filled as prefill chunks report them; None: not asked.
    prompt_logprobs: PromptLogprobs | None = None
    trace_headers: Mapping[str, str] | None = None  # the caller's W3C trace context, for the tracer

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


@dataclass
class IterationStats:
    """One step's tokens as the frontend saw them (vLLM's IterationStats): generated tokens, and the prompts of
    the requests whose first token came in this step (their prefill ended here)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, tracer: RequestTracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self._core_to_request: dict[str, str] = {}
        # Spans of every finished request (tracing.py), when an OTLP endpoint is configured; None: no tracing.
        self.tracer = tracer
        self.last_iteration = IterationStats()  # of the latest process() call

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        samples: list[tuple[str, SamplingParams]],  # (engine-core id, params) per sample
        arrival_time: float,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        state = _RequestState(request_id, prompt, prompt_token_ids, {}, RequestMetrics(arrival_time))
        state.trace_headers = trace_headers
        state.output_kind = samples[0][1].output_kind if samples else RequestOutputKind.CUMULATIVE
        if samples and samples[0][1].prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        for index, (core_id, params) in enumerate(samples):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            sample = _Sample(index, params, detok)
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            state.samples[core_id] = sample
            self._core_to_request[core_id] = request_id
        self.requests[request_id] = state

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def core_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.samples) if state else []

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns (RequestOutputs of requests that changed, core ids to abort)."""
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        iteration = self.last_iteration = IterationStats()
        timed = self.tracer is not None
        core_to_request, requests = self._core_to_request, self.requests
        final_only = RequestOutputKind.FINAL_ONLY
        for out in outputs:
            rid = core_to_request.get(out.request_id)
            if rid is None:
                continue
            state = requests[rid]
            sample = state.samples[out.request_id]
            if sample.finish_reason is not None:
                continue
            if out.error:
                state.error = out.error
            if out.events:
                _apply_events(state.metrics, out.events)
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state.prompt_logprobs, out.prompt_logprobs_start, out.new_prompt_logprobs)
            new_token_ids = out.new_token_ids
            if not new_token_ids and out.finish_reason is None and not out.error:
                continue  # a prefill chunk's prompt logprobs alone: shown with the first token
            if new_token_ids:
                m = state.metrics
                iteration.num_generation_tokens += len(new_token_ids)
                if m.first_token_time is None:
                    m.first_token_time = now
                    iteration.num_prompt_tokens += len(state.prompt_token_ids)
                m.last_token_time = now
                # One stamp per token: a speculative step delivers several at once (gaps of 0 between them),
                # so (last - first) / (n - 1) stays the mean time per token.
                if len(new_token_ids) == 1:
                    m.token_times.append(now)
                else:
                    m.token_times.extend([now] * len(new_token_ids))
                if out.num_cached_tokens > state.num_cached_tokens:
                    state.num_cached_tokens = out.num_cached_tokens
            sample.token_ids.extend(new_token_ids)
            if sample.logprobs is not None:
                self._add_logprobs(sample, out.new_logprobs)
            if timed and new_token_ids:
                started = time.perf_counter()
                stop_str = sample.detokenizer.update(new_token_ids)
                state.metrics.detokenize_seconds += time.perf_counter() - started
                state.metrics.detokenized_time = time.monotonic()
            else:
                stop_str = sample.detokenizer.update(new_token_ids)
            if stop_str is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            # A FINAL_ONLY request reports nothing until it finishes, and it can only finish in a step that
            # finished one of its samples: skip the others here (most of a batch, most steps).
            if sample.finish_reason is not None or state.output_kind != final_only:
                changed[rid] = state
        results = []
        for rid, state in changed.items():
            if state.finished:
                state.metrics.finished_time = time.monotonic()  # after the detokenizer (its span ends inside)
                del self.requests[rid]
                for core_id in state.samples:
                    self._core_to_request.pop(core_id, None)
            elif state.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            output = self._make_output(state)
            if state.finished and self.tracer is not None:
                self._trace(state, output)
            results.append(output)
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted (the caller aborts its core ids); returns its final output."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for core_id, sample in state.samples.items():
            self._core_to_request.pop(core_id, None)
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        output = self._make_output(state)
        if self.tracer is not None:
            self._trace(state, output)
        return output

    def _trace(self, state: _RequestState, output: RequestOutput) -> None:
        assert self.tracer is not None
        params = next(iter(state.samples.values())).params if state.samples else None
        try:
            self.tracer.trace(output, params, len(state.samples), state.trace_headers)
        except Exception:  # a trace is never worth a request: serving goes on without it
            logger.exception("tracing request %s failed", state.request_id)

    def _add_logprobs(self, sample: _Sample, entries: list[LogprobsEntry]) -> None:
        if sample.logprobs is None:
            return
        for entry in entries:
            position: dict[int, Logprob] = {}
            for tid, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
                if tid not in position:
                    position[tid] = Logprob(lp, rank, self._decode_one(tid))
            sample.logprobs.append(position)
            assert sample.cumulative_logprob is not None
            sample.cumulative_logprob += entry.logprobs[0]

    def _add_prompt_logprobs(self, slots: PromptLogprobs, start: int, entries: list[LogprobsEntry]) -> None:
        # Written by position, once: n samples each compute them, and a recompute after preemption repeats them.
        for pos, entry in enumerate(entries, start=start):
            if pos >= len(slots) or slots[pos] is not None:
                continue
            position: dict[int, Logprob] = {}
            for tid, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
                if tid not in position:  # the actual token comes first and may reappear in the top-N
                    position[tid] = Logprob(lp, rank, self._decode_one(tid))
            slots[pos] = position

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, state: _RequestState) -> RequestOutput:
        delta = state.output_kind == RequestOutputKind.DELTA
        completions = [
            self._completion(s, delta) for s in sorted(state.samples.values(), key=lambda s: s.index)
        ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            error=state.error,
            prompt_logprobs=state.prompt_logprobs,
        )

    @staticmethod
    def _completion(s: _Sample, delta: bool) -> CompletionOutput:
        text = s.detokenizer.output_text
        token_ids, logprobs = s.token_ids, s.logprobs
        if delta:  # only what this output adds; the next one starts where this one ends
            text, token_ids = text[s.sent_chars :], token_ids[s.sent_tokens :]
            logprobs = logprobs[s.sent_tokens :] if logprobs is not None else None
            s.sent_chars, s.sent_tokens = len(s.detokenizer.output_text), len(s.token_ids)
        else:
            token_ids = list(token_ids)
        return CompletionOutput(
            index=s.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=s.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )


def _apply_events(m: RequestMetrics, events: list[EngineCoreEvent]) -> None:
    """Fold a core output's events into the request's timeline; n samples each report theirs: the earliest
    queueing and the first scheduling of any of them count (a re-admission after a preemption does not)."""
    for event in events:
        if event.type == EngineCoreEventType.QUEUED:
            if m.queued_time is None or event.timestamp < m.queued_time:
                m.queued_time = event.timestamp
        elif event.type == EngineCoreEventType.SCHEDULED:
            if m.scheduled_time is None or event.timestamp < m.scheduled_time:
                m.scheduled_time = event.timestamp
        elif event.type == EngineCoreEventType.PREEMPTED:
            m.num_preemptions += 1
