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

NOTE 3 (encoder budget, encoder-decoder models). A request's encoder runs in the step that admits it, over its
whole encoder prompt, and those tokens are not in the token budget above (they are not the request's own
tokens). As vLLM's encoder compute budget does, the encoder prompts admitted in one step sum to at most
max_num_batched_tokens -- except the step's first, which always runs, so an encoder prompt longer than the
budget is not starved.
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
        # Requests whose KV-connector loads finished rejoin the running list (as prefills past what arrived).
        self.resume_loaded()

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
        # Parked requests (waiting for a connector's load) count against max_num_seqs: they hold blocks and
        # rejoin the running list when their KV arrives.
        max_seqs = self.config.max_num_seqs - len(self.loading)
        admitting = self.waiting and not preempted_now and len(self.running) < max_seqs
        reserved = self.headroom_blocks(headroom) if headroom and admitting else 0
        encoder_budget = self.config.max_num_batched_tokens  # NOTE 3
        while (self.waiting and budget > 0 and not preempted_now and len(self.running) < max_seqs
               and len(num_scheduled) < cap):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted while a step in flight samples for it: its token lands with the next update
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
            # Blocks a KV connector holds past the device hit are loaded, not computed: they get slots now.
            external, load_async = self.match_external(req, num_computed) if self.kv_connector is not None \
                else (0, False)
            if load_async:
                # They arrive in the background (a disk read): the request waits outside the batch, holding
                # its blocks, and costs this step nothing; the next ones go on being admitted.
                own = self.growth_blocks(req, headroom, num_computed + external) if headroom else 0
                if not self.park_for_external_load(req, num_computed, computed_blocks, external,
                                                   reserved + own if self.running else 0):
                    break
                max_seqs -= 1
                continue
            num_new = req.num_tokens - num_computed - external
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_encoder = req.num_encoder_tokens
            if num_encoder > encoder_budget and encoder_budget < self.config.max_num_batched_tokens:
                break  # NOTE 3: its encoder waits for the next step (the first one each step always runs)
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
            encoder_budget -= num_encoder

        return self.make_output(num_scheduled)

    def _admit(self, req: Request, num_computed: int) -> None:
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        self.running.append(req)
