"""Executor protocol: how one engine replica runs its model on its tensor-parallel ranks.

The engine core process is rank 0: it builds the scheduler and its own shard of the model like a
single-process engine, and the executor runs ranks 1..N-1 elsewhere (local processes, Ray actors). Per step
the executor sends the SchedulerOutput to every remote rank, runs rank 0's model runner (ModelRunnerProtocol),
and returns rank 0's ModelRunnerOutput; the ranks meet inside the model's collectives.

Lifecycle, driven by the builder:

    executor = cls(ExecutorContext(config))
    executor.start()          remote ranks launched; this process joins the group as rank 0 (blocks until all
                              have joined)
    ... rank 0's model, KV cache and runner are built ...
    executor.bind(runner)     waits until every remote rank has built its shard (raises with its error)
    executor.execute_model(scheduler_output) -> ModelRunnerOutput      every step (synchronous scheduling)
    executor.execute_pipelined(scheduler_output) -> ModelRunnerOutput | None
                              every step with async scheduling: launches this step, returns the one before
    executor.check_health()   raises WorkerDiedError naming the dead rank
    executor.shutdown()       stops the remote ranks, leaves the group; idempotent
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedllm.plugin_spec import optional

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank of this replica stopped; the replica cannot run another step."""


@dataclass(frozen=True)
class ExecutorContext:
    """What an executor is built from."""

    config: EngineConfig

    @property
    def tp_size(self) -> int:
        return self.config.parallel.tensor_parallel_size


class ModelRunnerProtocol(Protocol):
    """What an executor calls on a rank's model runner (pagedllm.worker.model_runner.ModelRunner is one)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step synchronously: forward, sample, and return its output."""
        ...

    def execute_pipelined(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch one step and return the output of the step launched before (None if none)."""
        ...

    def release_cuda_graphs(self) -> None:
        """Destroy the captured CUDA graphs (before the rank leaves its tensor-parallel group)."""
        ...


class Executor(Protocol):
    def start(self) -> None:
        """Launch the remote ranks and join the tensor-parallel group as rank 0 (before the model is built)."""
        ...

    def bind(self, runner: ModelRunnerProtocol) -> None:
        """Take rank 0's runner and wait until every remote rank is ready; raise with a rank's build error."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return rank 0's output."""
        ...

    @optional
    def execute_pipelined(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch one step on every rank without waiting for it; return rank 0's output of the step launched
        before (None if none), as ModelRunner.execute_pipelined does (model_runner.py NOTES 1 and 2). Optional:
        an executor without it runs synchronously (the engine core says why when async scheduling is asked for).
        """
        ...

    def check_health(self) -> None:
        """Raise WorkerDiedError if a remote rank is gone."""
        ...

    def shutdown(self) -> None:
        """Stop the remote ranks and leave the group (safe to call twice)."""
        ...
