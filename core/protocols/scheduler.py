"""Scheduler protocol: which requests advance this step, by how many tokens.

Most schedulers subclass `pagedllm.sched.base.SchedulerBase`, which keeps the request bookkeeping, stop
checks and KV freeing, and only write `schedule()` — the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pagedllm.engine.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.plugin_spec import optional
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.stats import SchedulerStats


class Scheduler(Protocol):
    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING)."""
        ...

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work within the token budget, max_num_seqs and free KV blocks."""
        ...

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests; return per-request outputs."""
        ...

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort); frees their KV blocks at once."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    @optional
    def get_num_unfinished_requests(self) -> int:
        """How many requests are waiting or running.

        Optional: the engine asks `has_unfinished_requests`, never this (SchedulerBase provides both).
        """
        ...

    def get_stats(self) -> SchedulerStats: ...
