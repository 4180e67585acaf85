"""FCFS continuous batching with chunked prefill and preemption by recompute (vLLM V1's default policy).

One token budget per step is shared by everything: a decoding request costs 1 (plus its draft tokens when
speculative decoding proposed some), a prefill costs its prompt (or the chunk of it that still fits). RUNNING requests go first, in admission order; WAITING requests are
admitted while budget, `max_num_seqs` and KV blocks last. When a running request cannot get a block, the
most recently admitted running request is preempted (its blocks freed, recomputed later) until it can.

NOTE 2 (admission headroom, `scheduler.admission_headroom_tokens`). vLLM admits a waiting request whenever its
prompt's blocks are free; the running requests then outgrow the pool and the newest are preempted and
recomputed. Measured on the H200 at max_num_seqs 1024: W1's 1,000 prompts of 1024 tokens fill 64 of 55,384
blocks each, so ~865 are admitted and ~55 are preempted as their 128 outputs grow (perf-notes §14c). Here a
request is admitted only if the free blocks left after it still cover every running request's next
`headroom` tokens (capped by its max_tokens: W1's 128) and its own: W1 admits ~770, none is preempted.
Preemption stays the fallback for growth beyond the headroom.
"""

from __future__ import annotations

from pagedllm.api.sched import Request, RequestStatus, SchedulerBase, SchedulerOutput


class FCFSScheduler(SchedulerBase):
    # Running requests go by num_tokens_with_spec and skip ends_in_flight; a waiting request with a token in
    # flight is not admitted until it lands.
    supports_async_scheduling = True
    # With hold_in_flight (pipeline parallelism) a running request with a sample in flight waits for it.
    supports_pipeline_batches = True

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted_now = False

        # 1. Running requests: decodes and unfinished prefill chunks. This loop runs for every running request
        #    at every step, so the checks are written out on the request's fields (ends_in_flight and
        #    num_tokens_with_spec, without their calls).
        running, allocate_slots, max_model_len = self.running, self.kv.allocate_slots, self.max_model_len
        hold, cap = self.hold_in_flight, self.batch_request_cap or self.config.max_num_seqs
        i = 0
        while i < len(running) and budget > 0 and len(num_scheduled) < cap:
            req = running[i]
            pending = req.num_output_placeholders
            num_outputs = len(req.output_token_ids) + pending
            num_tokens = len(req.prompt_token_ids) + num_outputs  # known and in flight
            if pending:  # ends_in_flight(req), written out
                max_tokens = req.sampling_params.max_tokens
                if hold or (max_tokens is not None and num_outputs >= max_tokens) or num_tokens >= max_model_len:
                    i += 1  # async scheduling: its last token is being sampled now (or, held, any token)
                    continue
            # Draft tokens (speculative decoding) ride along: they cost budget and KV slots like any token.
            num_new = num_tokens + len(req.spec_token_ids) - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1  # nothing new to compute yet (e.g. a request waiting for its drafts' verification)
                continue
            while allocate_slots(req, num_new) is None:
                # NOTE(1): out of blocks. Evict from the tail (latest admitted): it has done the least work.
                victim = running.pop()
                self.preempt(victim)
                preempted_now = True
                if victim is req:
                    break
            else:
                num_scheduled[req.request_id] = num_new
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing behind it is left to schedule

        # 2. Waiting requests, unless this step had to preempt (then memory is the bottleneck; admitting
        #    more would just preempt again), each only if the running ones keep their headroom (NOTE 2).
        headroom = self.config.admission_headroom_tokens
        admitting = self.waiting and not preempted_now and len(self.running) < self.config.max_num_seqs
        reserved = self.headroom_blocks(headroom) if headroom and admitting else 0
        while (self.waiting and budget > 0 and not preempted_now and len(self.running) < self.config.max_num_seqs
               and len(num_scheduled) < cap):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted while a step in flight samples for it: its token lands with the next update
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
            # Blocks a KV connector holds past the device hit are loaded, not computed: they get slots now.
            external = self.external_prefix_hit(req, num_computed) if self.kv_connector is not None else 0
            num_new = req.num_tokens - num_computed - external
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            own = self.growth_blocks(req, headroom, num_computed + external + num_new) if headroom else 0
            # With nothing running the request is admitted whatever its growth: something must make progress.
            reserve = reserved + own if self.running else 0
            if self.kv.allocate_slots(req, external + num_new, num_computed, computed_blocks, reserve) is None:
                break
            reserved += own
            self.waiting.popleft()
            if external:
                self.admit_external(req, num_computed, external)
            self._admit(req, num_computed + external)
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        return self.make_output(num_scheduled)

    def _admit(self, req: Request, num_computed: int) -> None:
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        self.running.append(req)
