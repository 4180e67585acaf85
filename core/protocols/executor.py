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
    executor.launch_model(scheduler_output); executor.collect_model() -> ModelRunnerOutput
                              pipeline parallelism: up to pp steps in flight, outputs in launch order
    executor.check_health()   raises WorkerDiedError naming the dead rank
    executor.register_failure_callback(cb)   optional: cb(reason) from the executor's monitor thread on a death
    executor.shutdown()       stops the remote ranks, leaves the group; idempotent
"""

from __future__ import annotations

from collections.abc import Callable
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

    @property
    def pp_size(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Every rank of the replica: tp_size x pp_size (global rank = pp_rank * tp_size + tp_rank)."""
        return self.tp_size * self.pp_size


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

    @optional
    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        """Pipeline parallelism: send one step to every rank and run rank 0's (first) stage, without waiting
        for the last stage; `collect_model` returns its output. Optional: an executor without it runs a
        pipeline-parallel engine one step at a time (execute_model)."""
        ...

    @optional
    def collect_model(self) -> ModelRunnerOutput:
        """The output of the oldest step `launch_model` sent and not yet collected (the last stage's)."""
        ...

    def check_health(self) -> None:
        """Raise WorkerDiedError if a remote rank is gone."""
        ...

    @optional
    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        """Have `callback(reason)` called, once and from a thread of the executor's, as soon as a remote rank is
        seen dead (a monitor on the rank processes, as vLLM's MultiprocExecutor has), even while rank 0 is
        inside a step. The engine core uses it to end a step that would otherwise wait in a collective for a
        dead peer until the group timeout (NCCL; engine/rank_watchdog.py). Optional: without it a death is
        found by `check_health` between steps and by a step that fails on its own."""
        ...

    def shutdown(self) -> None:
        """Stop the remote ranks and leave the group (safe to call twice)."""
        ...
