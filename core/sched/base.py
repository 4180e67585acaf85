"""SchedulerBase: request bookkeeping shared by every scheduling policy.

A policy plugin subclasses this and writes `schedule()`. Everything else a scheduler must get right — the
waiting/running queues, applying a step's sampled tokens, stop rules, preemption, aborts and freeing KV
blocks — lives here once, so a new policy cannot get it subtly wrong.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedllm.config import SchedulerConfig
from pagedllm.engine.messages import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.stats import SchedulerStats
from pagedllm.sched.stop import check_stop


@dataclass
class SchedulerContext:
    """What the engine hands a scheduler plugin's constructor."""

    config: SchedulerConfig
    kv_cache_manager: Any  # pagedllm.kv_cache.kv_cache_manager.KVCacheManager
    max_model_len: int
    block_size: int
    plugin_config: dict[str, Any]  # the config's `plugins.<scheduler name>` section


class SchedulerBase:
    # Async scheduling (engine_core.py NOTE 1) runs schedule() while the previous step is in flight. A policy
    # that declares it must: schedule running requests by `num_tokens_with_spec` (it counts the in-flight
    # placeholders), skip those `ends_in_flight`, and not admit a waiting (preempted) request while its
    # `num_output_placeholders` > 0 (its in-flight token is not in its prompt+outputs yet).
    # Policies that do not declare it run with synchronous steps.
    supports_async_scheduling: ClassVar[bool] = False

    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.kv = ctx.kv_cache_manager
        self.max_model_len = ctx.max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ended or preempted since the last schedule(): the runner must drop their cached state.
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # Requests the runner already holds state for (so they are sent as "cached", not "new").
        self._in_runner: set[str] = set()
        # Block ids already told to the runner, per request, so only appended ones are sent each step.
        self._sent_blocks: dict[str, list[list[int]]] = {}
        self._stats = SchedulerStats()

    # -- requests in and out -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        assert RequestStatus.is_finished(status)
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_stats(self) -> SchedulerStats:
        s = self._stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = self.kv.usage
        pc = self.kv.make_prefix_cache_stats()
        s.prefix_cache_queries += pc.queries
        s.prefix_cache_hits += pc.hits
        return s

    # -- policy ----------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    # -- helpers for policies ---------------------------------------------------------------------------------

    def ends_in_flight(self, request: Request) -> bool:
        """Async scheduling: the tokens a step in flight samples already take the request to max_tokens or
        the context limit, so it will finish when they land; scheduling it again would compute past its end."""
        pending = request.num_output_placeholders
        if not pending:
            return False
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens + pending >= max_tokens:
            return True
        return request.num_tokens + pending >= self.max_model_len

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it to be recomputed from scratch (first in line)."""
        request.status = RequestStatus.PREEMPTED
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # the runner forgets the request, and with it the drafts' probabilities
        request.num_preemptions += 1
        self._stats.num_preemptions += 1
        self._in_runner.discard(request.request_id)
        self._sent_blocks.pop(request.request_id, None)
        self._preempted_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def make_output(self, num_scheduled: dict[str, int]) -> SchedulerOutput:
        """Build the runner's message for the requests in `num_scheduled` and advance their computed counts.

        num_computed_tokens moves forward now, before the step runs: the next schedule() then sees the
        request's progress without waiting for the runner (as in vLLM V1).
        """
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            # Tokens scheduled past the known ones are drafts (a policy that counts num_tokens_with_spec);
            # drafts the budget left out are dropped: a proposal is only good for the step after it.
            num_spec = max(0, req.num_computed_tokens + n - req.num_tokens - req.num_output_placeholders)
            assert num_spec <= len(req.spec_token_ids), f"{rid}: {n} tokens scheduled beyond its drafts"
            del req.spec_token_ids[num_spec:]
            if num_spec:
                spec_tokens[rid] = list(req.spec_token_ids)
            block_ids = self.kv.get_block_ids(rid)
            if rid in self._in_runner:
                sent = self._sent_blocks[rid]
                cached.append(
                    CachedRequestData(rid, [ids[len(s):] for ids, s in zip(block_ids, sent)], req.num_computed_tokens)
                )
            else:
                new_reqs.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.sampling_params,
                        [list(ids) for ids in block_ids],
                        req.num_computed_tokens,
                    )
                )
                self._in_runner.add(rid)
            self._sent_blocks[rid] = [list(ids) for ids in block_ids]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                # This step samples the request's next token: until update_from_output brings it, it is a
                # placeholder (with synchronous steps the update comes before any other schedule()).
                req.num_output_placeholders += 1
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(num_scheduled),
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self._finished_ids, self._preempted_ids = set(), set()
        self._stats.num_steps += 1
        return out

    # -- after the step ---------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        proposals = runner_output.spec_token_ids
        for i, rid in enumerate(runner_output.req_ids):
            req = self.requests.get(rid)
            sampled = runner_output.sampled_token_ids[i]
            if req is None or req.is_finished() or not sampled:
                continue  # aborted during the step, or a prefill chunk that is not the last
            req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
            # Async scheduling: a request may have been preempted by a schedule() that ran while this step was
            # in flight. Its token is right (its KV was intact when it was computed): keep it; the recompute
            # includes it.
            queue = self.running if req.status == RequestStatus.RUNNING else self.waiting
            num_drafts = len(spec_scheduled.get(rid, ()))
            if num_drafts:
                # Verification emitted the accepted drafts plus one token; the rejected drafts' KV slots
                # are rolled back (overwritten later; never hashed, see kv_cache_manager.allocate_slots).
                num_accepted = len(sampled) - 1
                req.num_computed_tokens -= num_drafts - num_accepted
                self._stats.record_spec_decode(num_drafts, num_accepted)
            req.spec_token_ids = []
            new_tokens: list[int] = []
            for token in sampled:
                req.output_token_ids.append(token)
                new_tokens.append(token)
                if check_stop(req, self.max_model_len):
                    break  # a stop inside the accepted tokens truncates them
            lp = runner_output.logprobs[i]
            out = EngineCoreOutput(
                rid, new_tokens, lp[: len(new_tokens)] if lp is not None else [],
                num_cached_tokens=max(req.num_cached_tokens, 0),
            )
            if req.is_finished():
                out.finish_reason = req.get_finish_reason()
                out.stop_reason = req.stop_reason
                queue.remove(req)
                self._free(req)
            elif proposals and proposals[i]:
                req.spec_token_ids = list(proposals[i])
            outputs.append(out)
        return outputs

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._sent_blocks.pop(req.request_id, None)
        if req.request_id in self._in_runner:
            self._in_runner.discard(req.request_id)
            self._finished_ids.add(req.request_id)
        self._preempted_ids.discard(req.request_id)
