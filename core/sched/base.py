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
from pagedllm.request import EngineCoreEventType, Request, RequestStatus
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
    # Pipeline parallelism (engine_core.py NOTE 3) keeps up to pipeline_parallel_size batches in flight. A
    # policy that declares it must, while `hold_in_flight` is set (the engine sets it), not schedule a running
    # request whose `num_output_placeholders` > 0: its next input token is still on its way from the last
    # stage; and schedule at most `batch_request_cap` requests (when set) in one step, so the requests spread
    # over the micro-batches. Other policies run pipeline-parallel engines one batch at a time.
    supports_pipeline_batches: ClassVar[bool] = False
    hold_in_flight: bool = False
    batch_request_cap: int | None = None
    # A KV connector (protocols/kv_connector.py) the engine set, or None: admission asks it for prefix hits
    # beyond the device cache (`external_prefix_hit`, or `match_external` + `park_for_external_load` for hits
    # that arrive in the background), make_output hands its plan to the runner.
    kv_connector: Any = None

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
        # How many block ids per KV-cache group the runner already holds, per request: only appended ones are
        # sent each step (block lists only grow while a request holds them; counts, not copies, so a decode
        # step costs no O(blocks) work).
        self._sent_blocks: dict[str, list[int]] = {}
        self._num_groups: int = self.kv.num_groups
        self._block_size: int = self.kv.block_size  # the smallest over the groups (allocate_slots' bs)
        self._stats = SchedulerStats()
        # Parked requests (WAITING_FOR_REMOTE_KVS): their blocks are being filled by the KV connector in the
        # background; request id -> (request, tokens computed on the device before the external hit).
        self.loading: dict[str, tuple[Request, int]] = {}

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
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.loading[rid]  # (the connector hears of it in _free: request_finished)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def get_stats(self) -> SchedulerStats:
        s = self._stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting) + len(self.loading)
        s.kv_cache_usage = self.kv.usage
        pc = self.kv.make_prefix_cache_stats()
        s.prefix_cache_queries += pc.queries
        s.prefix_cache_hits += pc.hits
        if self.kv_connector is not None:
            s.kv_connector = self.kv_connector.stats()
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
        # Lengths read directly: called for every running request at every step (async scheduling).
        num_outputs = len(request.output_token_ids) + pending
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and num_outputs >= max_tokens:
            return True
        return len(request.prompt_token_ids) + num_outputs >= self.max_model_len

    def growth_blocks(self, req: Request, headroom: int, computed: int) -> int:
        """Blocks, in every KV-cache group, for the tokens `req` knows but has not computed past `computed`
        plus up to `headroom` more outputs (no more than its max_tokens or the context allows): what an
        admission that keeps `scheduler.admission_headroom_tokens` must leave free for it (fcfs NOTE 2)."""
        num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_output_placeholders
        max_tokens = req.sampling_params.max_tokens
        left = self.max_model_len - num_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - len(req.output_token_ids) - req.num_output_placeholders)
        tokens = max(0, num_tokens - computed) + max(0, min(headroom, left))
        return -(-tokens // self._block_size) * self._num_groups

    def headroom_blocks(self, headroom: int) -> int:
        """growth_blocks summed over the running requests, from what each has computed."""
        return sum(self.growth_blocks(req, headroom, req.num_computed_tokens) for req in self.running)

    def external_prefix_hit(self, req: Request, num_computed: int) -> int:
        """Prompt tokens past the device prefix hit (`num_computed`) that the KV connector holds (0 without one).

        Whole blocks, and the total stays below the request's known tokens (the last is always computed: its
        logits sample the next token). A policy admitting `req` allocates them with the tokens it schedules,
        `allocate_slots(req, external + num_new, num_computed, ...)`, then calls `admit_external`. A hit the
        connector would load in the background counts as none here: this admission path has no way to wait
        for it (a policy that can park requests calls `match_external`).
        """
        found, load_async = self.match_external(req, num_computed)
        return 0 if load_async else found

    def match_external(self, req: Request, num_computed: int) -> tuple[int, bool]:
        """`external_prefix_hit` and whether those tokens arrive in the background (protocols/kv_connector.py):
        a policy then parks the request with `park_for_external_load` instead of scheduling it."""
        connector = self.kv_connector
        if connector is None or req.sampling_params.prompt_logprobs is not None:
            return 0, False  # prompt logprobs need every position computed, as for device hits
        answer = connector.get_num_new_matched_tokens(req, num_computed)
        found, load_async = answer if isinstance(answer, tuple) else (answer, False)
        limit = (req.num_tokens - 1) // self._block_size * self._block_size - num_computed
        found = max(0, min(found, limit))
        return found, load_async and found > 0

    def admit_external(self, req: Request, num_computed: int, num_external: int) -> None:
        """Tell the connector which blocks of `req` (allocated just now) its `num_external` tokens go into."""
        if num_external:
            first = num_computed // self._block_size
            blocks = self.kv.get_block_ids(req.request_id)[0][first : first + num_external // self._block_size]
            self.kv_connector.update_state_after_alloc(req, blocks, num_external)

    def park_for_external_load(self, req: Request, num_computed: int, computed_blocks: Any, num_external: int,
                               num_reserved_blocks: int = 0) -> bool:
        """Give the waiting `req` blocks for its device hit and the `num_external` tokens the connector loads in
        the background, and park it outside the batch until they arrive (False: no blocks; nothing changed).

        The external blocks are not registered in the prefix cache yet (their KV is not there): another
        request must not hit them before the load lands. They are registered when the request is next
        scheduled, as any block it computes. The caller removes nothing: `req` leaves `waiting` here.
        """
        if self.kv.allocate_slots(req, num_external, num_computed, computed_blocks, num_reserved_blocks,
                                  delay_cache_blocks=True) is None:
            return False
        self.waiting.remove(req)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = num_computed
        self.loading[req.request_id] = (req, num_computed)
        self.admit_external(req, num_computed, num_external)
        return True

    def resume_loaded(self) -> None:
        """Parked requests whose loads finished rejoin the running list as prefills past what arrived (vLLM's
        `_update_waiting_for_remote_kv`); called first in `schedule()`. Blocks that failed to load are simply
        computed: the request holds them, its computed count stops before them."""
        if not self.loading:
            return
        # Nothing else to run: the connector may wait briefly for a load instead of the engine spinning.
        idle = not self.running and not self.waiting
        for rid, num_loaded in self.kv_connector.get_finished_loads(wait=idle).items():
            entry = self.loading.pop(rid, None)
            if entry is None:
                continue
            req, num_computed = entry
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed + num_loaded
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.running.append(req)

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it to be recomputed from scratch (first in line)."""
        request.status = RequestStatus.PREEMPTED
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # the runner forgets the request, and with it the drafts' probabilities
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
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
        requests, in_runner, sent_blocks = self.requests, self._in_runner, self._sent_blocks
        take_new_block_ids = self.kv.take_new_block_ids
        for rid, n in num_scheduled.items():
            req = requests[rid]
            # Known tokens plus those in flight (num_tokens + placeholders), read without the properties:
            # this loop runs once per scheduled request per step.
            num_known = len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_output_placeholders
            # Tokens scheduled past the known ones are drafts (a policy that counts num_tokens_with_spec);
            # drafts the budget left out are dropped: a proposal is only good for the step after it.
            num_spec = req.num_computed_tokens + n - num_known
            if num_spec > 0:
                assert num_spec <= len(req.spec_token_ids), f"{rid}: {n} tokens scheduled beyond its drafts"
                del req.spec_token_ids[num_spec:]
                spec_tokens[rid] = list(req.spec_token_ids)
            elif req.spec_token_ids:
                req.spec_token_ids.clear()
            if rid in in_runner:
                cached.append(
                    CachedRequestData(rid, take_new_block_ids(rid, sent_blocks[rid]), req.num_computed_tokens)
                )
            else:
                req.record_event(EngineCoreEventType.SCHEDULED)  # new to the runner: admitted or resumed
                sent = sent_blocks[rid] = [0] * self._num_groups
                new_reqs.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.sampling_params,
                        take_new_block_ids(rid, sent),
                        req.num_computed_tokens,
                        req.encoder_prompt_token_ids,
                    )
                )
                in_runner.add(rid)
            req.num_computed_tokens += n
            if req.num_computed_tokens >= num_known:
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
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta()
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
        requests, all_sampled, all_logprobs = self.requests, runner_output.sampled_token_ids, runner_output.logprobs
        max_model_len = self.max_model_len
        preempted, running = RequestStatus.PREEMPTED, RequestStatus.RUNNING
        finished_running: list[Request] = []
        prompt_lps = runner_output.prompt_logprobs
        for i, (rid, sampled, lp) in enumerate(zip(runner_output.req_ids, all_sampled, all_logprobs, strict=True)):
            req = requests.get(rid)
            if req is None or not sampled or req.status > preempted:
                if prompt_lps and rid in prompt_lps and req is not None and req.status <= preempted:
                    # A prefill chunk that is not the last still delivers the prompt logprobs it computed.
                    start, entries = prompt_lps[rid]
                    outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=entries,
                                                    prompt_logprobs_start=start))
                continue  # aborted during the step (finished), or a prefill chunk that is not the last
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            # Async scheduling: a request may have been preempted by a schedule() that ran while this step was
            # in flight. Its token is right (its KV was intact when it was computed): keep it; the recompute
            # includes it.
            num_drafts = len(spec_scheduled[rid]) if spec_scheduled and rid in spec_scheduled else 0
            if num_drafts:
                # Verification emitted the accepted drafts plus one token; the rejected drafts' KV slots
                # are rolled back (overwritten later; never hashed, see kv_cache_manager.allocate_slots).
                num_accepted = len(sampled) - 1
                req.num_computed_tokens -= num_drafts - num_accepted
                self._stats.record_spec_decode(num_drafts, num_accepted)
            if req.spec_token_ids:
                req.spec_token_ids = []
            was_running = req.status == running  # (check_stop may finish it)
            if len(sampled) == 1:  # the common case, without the per-token loop
                req.output_token_ids.append(sampled[0])
                new_tokens = sampled  # (the runner's output list is not touched after this)
                stopped = check_stop(req, max_model_len)
            else:
                new_tokens = []
                stopped = False
                for token in sampled:
                    req.output_token_ids.append(token)
                    new_tokens.append(token)
                    if check_stop(req, max_model_len):
                        stopped = True
                        break  # a stop inside the accepted tokens truncates them
            num_cached = req.num_cached_tokens
            out = EngineCoreOutput(
                rid, new_tokens, lp[: len(new_tokens)] if lp is not None else [], None, None,
                num_cached if num_cached > 0 else 0,
            )
            if prompt_lps and rid in prompt_lps:
                out.prompt_logprobs_start, out.new_prompt_logprobs = prompt_lps[rid]
            if req.events:
                out.events = req.take_events()
            if stopped:
                out.finish_reason = req.get_finish_reason()
                out.stop_reason = req.stop_reason
                if was_running:
                    finished_running.append(req)
                else:
                    self.waiting.remove(req)
                self._free(req)
            elif proposals and proposals[i]:
                req.spec_token_ids = list(proposals[i])
            outputs.append(out)
        if finished_running:
            # One pass over the running list for all of them: a batch of equal requests finishes in one step,
            # and list.remove per request would cost O(running) each.
            if len(finished_running) == 1:
                self.running.remove(finished_running[0])
            else:
                gone = set(map(id, finished_running))
                self.running[:] = [r for r in self.running if id(r) not in gone]
        return outputs

    def _free(self, req: Request) -> None:
        if self.kv_connector is not None:
            # The optional member (protocols/kv_connector.py, API 1.5): before the blocks go back to the pool.
            hook = getattr(self.kv_connector, "request_finished", None)
            if hook is not None:
                blocks = self.kv.get_block_ids(req.request_id)
                hook(req, list(blocks[0]) if blocks else [])
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._sent_blocks.pop(req.request_id, None)
        if req.request_id in self._in_runner:
            self._in_runner.discard(req.request_id)
            self._finished_ids.add(req.request_id)
        self._preempted_ids.discard(req.request_id)
