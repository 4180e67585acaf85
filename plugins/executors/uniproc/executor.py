"""UniprocExecutor: rank 0 is the only rank; a step is a direct call of its ModelRunner."""

from __future__ import annotations

from typing import Any

from pagedllm.api.executor import ExecutorContext
from pagedllm.api.sched import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    # Its runner is in the engine core's process and samples: it fills a pipelined step's grammar masks
    # itself (pagedllm.api.sched: SchedulerOutput.deferred_structured_output).
    fills_deferred_masks = True

    def __init__(self, ctx: ExecutorContext) -> None:
        if ctx.tp_size != 1:
            raise ValueError(f"uniproc executor: parallel.tensor_parallel_size must be 1, not {ctx.tp_size}")
        if ctx.pp_size != 1:
            raise ValueError(f"uniproc executor: parallel.pipeline_parallel_size must be 1, not {ctx.pp_size}")
        self._runner: Any = None

    def start(self) -> None:
        """Nothing to launch, no group to join."""

    def bind(self, runner: Any) -> None:
        self._runner = runner
        # The step is the runner's own method: no wrapper frame on the single-process hot path.
        self.execute_model = runner.execute  # type: ignore[method-assign]
        self.execute_pipelined = runner.execute_pipelined  # type: ignore[method-assign]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner.execute(scheduler_output)  # type: ignore[no-any-return]  # replaced in bind

    def execute_pipelined(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._runner.execute_pipelined(scheduler_output)  # type: ignore[no-any-return]  # replaced in bind

    def check_health(self) -> None:
        """The only rank is this process: alive by definition."""

    def shutdown(self) -> None:
        self._runner = None
