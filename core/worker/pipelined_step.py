"""The runner's pipelined step (async scheduling): launch step N+1, then return step N's output.

The mechanism is model_runner.py NOTE 1 (placeholders filled on the device from the step in flight) and
NOTE 2 (tensor parallelism: rank 0 samples and broadcasts). These methods are ModelRunner's (it inherits this
mixin); they live apart from the synchronous `execute` because they carry state from one step to the next
(`_pending`) that the synchronous path never has.

NOTE 5: a step with grammar masks (a DeferredBitmask) is sampled at the start of the next call, not right
after its forward is launched. Its masks need the previous step's tokens accepted by the grammars, work
(~5 ms a step at 256 JSON-schema requests on the H200 host) that the grammar worker does while the engine
applies outputs and schedules (structured_output/manager.py NOTE 4). Sampled at once, the runner waited for
that work first, and the engine's host work came after it: accept + host work in series, longer than the
forward, and the GPU waited. Sampled at the next call, the wait is for work that ran beside the host work;
the sample is still queued before the next forward, which reads its ids. The worker started on this step's
ids is joined by the next call too, so the engine applies a step before the grammars have accepted its
tokens: their verdicts reach `advance` one step later (manager.py NOTE 5). A step without masks samples at
once, as before. With tensor parallelism only rank 0 has the masks, and its broadcast of the ids moves with
its sampling to just before the next forward, where the other ranks' next collective is too. Measured on the
H200 at 256 requests (docs/perf-notes.md 28): the runner's wait for the ids went, but the overlap gained
nothing yet, as xgrammar's batch accept takes the GIL inside and slowed beside the engine thread's Python.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.distributed.communication import tp_broadcast
from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata, to_device
from pagedllm.sample.sampler import Sampler
from pagedllm.worker import prompt_logprobs
from pagedllm.worker.cuda_graphs import GPURunnerOptions
from pagedllm.worker.input_prep import StepInputs
from pagedllm.worker.pipeline_stage import PLACEHOLDER
from pagedllm.worker.request_state import CachedRequestState


@dataclass
class PendingStep:
    """A launched step whose sampled ids are still on their way to the host (NOTE 1)."""

    req_ids: list[str]
    sample_rows: list[int]
    states: list[CachedRequestState]  # the sampling rows' states (objects: a request may leave meanwhile)
    positions: list[int]  # index of each sampling row's PLACEHOLDER in its state's outputs
    sampled: torch.Tensor  # [len(sample_rows)] on the device: the next step gathers its input ids here
    host: torch.Tensor | None  # pinned copy of `sampled` (CUDA), valid once `ready` has happened
    ready: Any  # torch.cuda.Event, or None on the CPU (already synchronous)
    logprobs: Any  # LogprobsTensors | None
    # req_id -> (start position, LogprobsTensors) of the prompt logprobs computed by this step.
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Unsampled:
    """A launched step whose sampling waits (NOTE 5): its logits and what sampling them needs."""

    req_ids: list[str]
    sample_rows: list[int]
    rows: list[CachedRequestState]  # the sampling rows' states
    logits: torch.Tensor
    prompt_logprobs: dict[str, Any]
    deferred: Any  # DeferredBitmask | None
    mask: Any  # GrammarBitmask | None: a mask known at schedule time
    previous: ModelRunnerOutput | None  # the step before's output: the deferred mask is filled from it


class PipelinedSteps:
    """ModelRunner's pipelined half: `execute_pipelined` and the step it keeps in flight (`_pending`)."""

    if TYPE_CHECKING:  # ModelRunner's, which the methods below use
        model: Any
        device: torch.device
        vocab_size: int
        sampler: Sampler
        options: GPURunnerOptions
        tp_rank: int
        tp_size: int
        _pending: PendingStep | None
        _unsampled: _Unsampled | None
        _grammar_join: Callable[[], None] | None
        _sampled_host: torch.Tensor | None
        _last_metadata: SamplingMetadata | None
        _prompt_logprob_reqs: set[str]

        def _update_states(self, so: SchedulerOutput) -> None: ...

        def _layout(self, so: SchedulerOutput) -> tuple[list[str], list[CachedRequestState], list[int]]: ...

        def _forward_states(
            self,
            states: list[CachedRequestState],
            token_ids: list[list[int]],
            num_sched: list[int],
            fill: Callable[[torch.Tensor], None] | None = None,
        ) -> tuple[StepInputs, torch.Tensor]: ...

    @torch.inference_mode()
    def execute_pipelined(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch this step and return the previous one's output (None if there was none): NOTE 1.

        Not for speculative decoding (the engine runs it through `execute`). With tp > 1 every rank calls
        this for every step, in the same order; a remote rank's return value means nothing (NOTE 2).
        """
        self._sample_deferred()  # the step before's sampling, when it waited for its masks (NOTE 5)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return self._resolve_pending()
        req_ids, states, num_sched = self._layout(so)
        prompt_slots = (prompt_logprobs.plan(req_ids, states, num_sched, self._prompt_logprob_reqs)
                        if self._prompt_logprob_reqs else None)
        inputs, hidden = self._forward_states(states, [s.token_ids for s in states], num_sched,
                                              self._placeholder_fill(states, num_sched))
        # Kept on the device with the step; copied to the host when the step is resolved.
        prompt_lps = prompt_logprobs.compute(self.model, hidden, prompt_slots, self.vocab_size) if prompt_slots else {}
        # The forward is queued behind the previous step; now take that step's ids (waits for it alone).
        previous = self._resolve_pending()
        # Rows whose scheduled tokens reach the end of what is known sample; one pass over the batch.
        sample_rows = []
        for i, (s, n) in enumerate(zip(states, num_sched)):
            s.num_computed_tokens += n
            if s.num_computed_tokens >= s.num_tokens:
                sample_rows.append(i)
        if not sample_rows:
            self._pending = PendingStep(req_ids, [], [], [], torch.empty(0), None, None, None, prompt_lps)
            return previous
        logits_indices = inputs.logits_indices[: len(states)]
        if len(sample_rows) < len(states):  # (an index from a host list would wait for the forward)
            logits_indices = logits_indices[to_device(sample_rows, torch.int64, self.device)]
        logits = self.model.compute_logits(hidden[logits_indices])
        step = _Unsampled(req_ids, sample_rows, [states[i] for i in sample_rows], logits, prompt_lps,
                          so.deferred_structured_output, so.structured_output, previous)
        if step.deferred is not None:
            self._unsampled = step  # NOTE 5: sampled at the next call, once the engine's host work is done
        else:
            self._sample(step)
        return previous

    def _sample_deferred(self) -> None:
        """NOTE 5: join the grammar work in flight (it filled the masks of the step waiting here), then
        sample that step and start the grammars on its ids."""
        join, self._grammar_join = self._grammar_join, None
        if join is not None:
            join()
        step, self._unsampled = self._unsampled, None
        if step is not None:
            self._sample(step)

    def _sample(self, step: _Unsampled) -> None:
        """Mask (if the step has masks), sample and start the copy of the ids to the host: the step becomes
        the one in flight (`_pending`)."""
        req_ids, sample_rows, rows, logits, deferred = step.req_ids, step.sample_rows, step.rows, step.logits, step.deferred
        # A deferred mask is filled now, from the previous step's ids (structured_output/manager.py NOTE 3;
        # mostly filled already, by the grammar worker: NOTE 4); only rank 0 has one, as only rank 0 samples.
        mask = deferred.resolve(step.previous) if deferred is not None else step.mask
        if mask is not None:
            mask.apply(logits, [req_ids[i] for i in sample_rows], [1] * len(sample_rows))
        sampled_ids, logprobs = self._sample_pipelined(logits, rows)
        host, ready = None, None
        if self.device.type == "cuda":
            n = len(rows)
            if self._sampled_host is None or self._sampled_host.numel() < n:
                self._sampled_host = torch.empty(max(n, self.options.max_num_seqs), dtype=torch.int64,
                                                 pin_memory=True)
            host = self._sampled_host[:n]
            host.copy_(sampled_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        positions = [r.append_output(PLACEHOLDER) for r in rows]
        # This step's ids go to the grammars on the manager's worker as soon as they exist, beside the engine's
        # host work until the next step (manager.py NOTE 4); the next call joins it (NOTE 5).
        if deferred is not None:
            self._grammar_join = deferred.accept_ahead(req_ids, sample_rows,
                                                       _ids_fetch(sampled_ids, host, ready, self.device))
        self._pending = PendingStep(req_ids, sample_rows, rows, positions, sampled_ids, host, ready, logprobs,
                                    step.prompt_logprobs)

    def _sample_pipelined(self, logits: torch.Tensor, rows: list[CachedRequestState]) -> tuple[torch.Tensor, Any]:
        """This step's sampled ids on the device, and their logprobs (rank 0's only: NOTE 2). Every rank has
        computed the logits (the LM head's all-gather is a collective); only rank 0 samples from them."""
        if self.tp_rank == 0:
            metadata = SamplingMetadata.build(
                [r.sampling_params for r in rows], [r.generator for r in rows], [r.prompt_token_ids for r in rows],
                [r.output_token_ids for r in rows], self.vocab_size, self.device, reuse=self._last_metadata,
            )
            self._last_metadata = metadata
            out = self.sampler(logits, metadata)
            sampled, logprobs = out.sampled_token_ids.to(torch.int64).contiguous(), out.logprobs
        else:
            sampled, logprobs = torch.empty(len(rows), dtype=torch.int64, device=self.device), None
        return tp_broadcast(sampled, self.tp_size), logprobs

    def _placeholder_fill(
        self, states: list[CachedRequestState], num_sched: list[int]
    ) -> Callable[[torch.Tensor], None] | None:
        """The device-side write of the previous step's samples into this step's input ids (NOTE 1)."""
        pending = self._pending
        if pending is None or not pending.states:
            return None
        sampled = pending.sampled
        n = len(states)
        if (
            len(pending.states) == n
            and all(map(operator.is_, pending.states, states))
            and all(k == 1 for k in num_sched)
            and all(s.num_computed_tokens + 1 == len(s.token_ids) for s in states)
        ):
            # The steady decode step: the same requests as the step in flight, in the same order, each
            # scheduling just its pending token (its last), so row j takes sample j (the general loop below
            # would find exactly this, at ~1 µs a request).
            def fill_all(input_ids: torch.Tensor) -> None:
                input_ids[:n] = sampled

            return fill_all
        src_of = {id(st): j for j, st in enumerate(pending.states)}
        dst, src = [], []
        row = 0
        for s, n in zip(states, num_sched, strict=True):
            row += n
            j = src_of.get(id(s))
            if j is not None and s.token_ids[s.num_computed_tokens + n - 1] == PLACEHOLDER:
                # A request scheduled right after sampling schedules exactly its one pending token.
                dst.append(row - 1)
                src.append(j)
        if not dst:
            return None
        index = to_device([dst, src], torch.int64, self.device)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids[index[0]] = sampled[index[1]]

        return fill

    def _resolve_pending(self) -> ModelRunnerOutput | None:
        """Wait for the step in flight, write its ids over the placeholders, and return its output."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        n = len(pending.req_ids)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[Any] = [None] * n
        if pending.sample_rows:
            if pending.ready is not None:
                pending.ready.synchronize()
                tokens = pending.host.tolist() if pending.host is not None else []
            else:
                tokens = pending.sampled.tolist()
            for state, pos, row, token in zip(pending.states, pending.positions, pending.sample_rows, tokens,
                                              strict=True):
                state.set_output(pos, token)
                sampled[row] = [token]
            if pending.logprobs is not None:
                entries = pending.logprobs.to_entries([st.sampling_params.logprobs for st in pending.states])
                for j, i in enumerate(pending.sample_rows):
                    logprobs[i] = None if entries[j] is None else [entries[j]]
        return ModelRunnerOutput(pending.req_ids, sampled, logprobs, [],
                                 prompt_logprobs.to_entries(pending.prompt_logprobs) if pending.prompt_logprobs else {})


def _ids_fetch(sampled: torch.Tensor, host: torch.Tensor | None, ready: Any,
               device: torch.device) -> Callable[[], list[int]]:
    """A step's sampled ids as a host list, for another thread (the grammar worker): on CUDA it waits for the
    step's event (the GIL released meanwhile) and reads the pinned copy; on the CPU the ids are there."""
    if ready is None or host is None:
        return sampled.tolist

    def fetch() -> list[int]:
        with torch.cuda.device(device):
            ready.synchronize()
        return host.tolist()

    return fetch
