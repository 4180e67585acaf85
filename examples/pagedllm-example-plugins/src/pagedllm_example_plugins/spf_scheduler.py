"""Shortest prompt first: among waiting requests, the one with the fewest prompt tokens is admitted first.

Everything but the admission order comes from pagedllm's SchedulerBase (queues, stop rules, freeing blocks,
preemption), so the policy is this one screen.
"""

from __future__ import annotations

from collections import deque

from pagedllm.api.sched import Request, RequestStatus, SchedulerBase, SchedulerContext, SchedulerOutput


class ShortestPromptFirstScheduler(SchedulerBase):
    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        self.admission_order: list[str] = []  # request ids in the order they first ran (for tests and logs)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}

        # 1. Running requests keep running while blocks last (preempting from the tail, as fcfs does).
        for req in list(self.running):
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0 or req not in self.running:
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self.preempt(victim)
                if victim is req:
                    break
            else:
                num_scheduled[req.request_id] = num_new
                budget -= num_new

        # 2. Waiting: preempted requests first (they already did work), then shortest prompt, then arrival.
        self.waiting = deque(sorted(self.waiting, key=_admission_key))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed_blocks, num_computed = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_computed, budget)
            if self.kv.allocate_slots(req, num_new, num_computed, computed_blocks) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            self.running.append(req)
            if req.request_id not in self.admission_order:
                self.admission_order.append(req.request_id)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
        return self.make_output(num_scheduled)


def _admission_key(req: Request) -> tuple[bool, int, float]:
    return req.num_preemptions == 0, req.num_prompt_tokens, req.arrival_time
