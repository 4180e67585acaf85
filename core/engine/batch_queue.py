"""Pipeline parallelism's batch queue: up to pipeline_parallel_size steps in flight, so the stages overlap.

vLLM V1's EngineCore.step_with_batch_queue, here. With P stages a step occupies one stage at a time; run
one step at a time and P - 1 stages idle. So each engine step first launches a new batch while the queue
has room (the executor's `launch_model` returns once rank 0's first stage has sent its output on), and
waits for the oldest batch's output only when the queue is full or nothing more can be scheduled:

    P = 2    stage 0:  A0  B0  .   C0  D0  ...      A0 = batch A on stage 0
             stage 1:  .   A1  B1  .   C1  ...      C is scheduled when A's tokens have landed

The scheduler holds back a request whose sampled token is still in flight (SchedulerBase.hold_in_flight):
its next input is not known yet, so a micro-batch holds other requests, or the next chunk of a prompt
(stages run their batches in launch order, so a chunk's KV is written before the next chunk reads it).
And it takes at most 1/P of the unfinished requests per step (`batch_request_cap`, rounded up): otherwise
the first batch would take every request and the next find none to run (as vLLM V1 without enough
requests). A lone request still runs one step at a time: its tokens depend on each other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from pagedllm.engine.messages import EngineCoreOutput, SchedulerOutput


class BatchQueue:
    def __init__(self, executor: Any, scheduler: Any, depth: int) -> None:
        self.executor, self.scheduler, self.depth = executor, scheduler, depth
        self._queue: deque[SchedulerOutput] = deque()  # launched, output not yet collected (oldest first)
        scheduler.hold_in_flight = True

    def __len__(self) -> int:
        return len(self._queue)

    def step(
        self,
        outputs: list[EngineCoreOutput],
        before_launch: Callable[[SchedulerOutput], None] | None = None,
        after_update: Callable[[list[EngineCoreOutput]], None] | None = None,
    ) -> SchedulerOutput | None:
        """Launch a batch if there is room (and something to run), else apply the oldest batch's output;
        returns the batch launched, if any. `before_launch` / `after_update`: structured outputs' masks and
        grammar advances (engine_core.py NOTE 2)."""
        scheduler = self.scheduler
        if len(self._queue) < self.depth and scheduler.has_unfinished_requests():
            unfinished = len(scheduler.running) + len(scheduler.waiting)
            scheduler.batch_request_cap = max(1, -(-unfinished // self.depth))
            so = scheduler.schedule()
            # An empty step still tells the runners which requests ended (their ids are in it only once).
            if not so.is_empty or so.finished_req_ids or so.preempted_req_ids:
                if before_launch is not None:
                    before_launch(so)
                self.executor.launch_model(so)
                self._queue.append(so)
                if len(self._queue) < self.depth and not so.is_empty:
                    return so  # fill the pipeline before waiting for anything
                self._apply_oldest(outputs, after_update)
                return so
        if self._queue:
            self._apply_oldest(outputs, after_update)
        return None

    def _apply_oldest(
        self, outputs: list[EngineCoreOutput], after_update: Callable[[list[EngineCoreOutput]], None] | None
    ) -> None:
        so = self._queue.popleft()
        step_outputs = self.scheduler.update_from_output(so, self.executor.collect_model())
        if after_update is not None:
            after_update(step_outputs)
        outputs.extend(step_outputs)
