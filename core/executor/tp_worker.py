"""TPWorker: one remote rank (1..N-1) of an engine replica, wherever it runs: a tensor-parallel rank, a
pipeline stage's rank, or both (N = tp x pp; global rank = pp_rank * tp + tp_rank, parallel_state NOTE 4).

Executors host it in a process of their choosing (a spawned local process, a Ray actor). It joins the
group, builds the same engine as rank 0 with its own rank (so every shape, KV-block count and compiled
graph matches), then runs each step rank 0 sends it. Its sampled tokens are thrown away:

NOTE 1: every rank computes the same logits (the LM head all-gathers them), but a rank's *sampled* token may
still differ from rank 0's (unseeded rows draw from each process's own default generator; a logits processor
plugin runs only in rank 0). Each synchronous step therefore carries rank 0's previous output, and the worker
writes those tokens over its own before running, so all ranks always feed the model the same token ids.

NOTE 2: a pipelined step (async scheduling) carries no previous output: the runners themselves broadcast rank
0's sampled ids every step (model_runner.py NOTE 2). Rank 0 sends and goes on (no reply); the worker runs the
steps in the order they were sent, and the collectives keep the ranks within a step of each other.

NOTE 3: `close` destroys the runner's CUDA graphs before leaving the group: NCCL will not destroy a
communicator that a live graph references (cuda_graphs.py NOTE 5). Rank 0's executor does the same.

NOTE 4: with pipeline parallelism only the last stage samples, so the step's output is that stage's
tensor-parallel rank 0's (the "output rank"): its worker returns it, the executor carries it back to rank 0
(a queue, a Ray return value), and rank 0 sends every output that landed since its last step with the next
step as `previous`. Every rank -- rank 0 too, whose first stage embeds the tokens -- writes those tokens
over its placeholders (NOTE 1's adoption; worker/pipeline_stage.py) before running the step. Up to
pipeline_parallel_size steps are in flight (`launch_model` / `collect_model`, engine_core.py NOTE 3); the
scheduler holds back a request whose token is in flight, so a request is only scheduled again after its
output landed, and so after the message that carries its token.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import torch

from pagedllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm")


class TPWorker:
    def __init__(self, config_dict: dict[str, Any], rank: int, master_addr: str, master_port: int) -> None:
        from pagedllm.config import EngineConfig

        self.config = EngineConfig.model_validate(config_dict)
        self.rank = rank
        parallel = self.config.parallel
        self.tp_rank, self.pp_rank = rank % parallel.tensor_parallel_size, rank // parallel.tensor_parallel_size
        # NOTE 4: the last stage's tensor-parallel rank 0 returns the step's output.
        self.returns_output = (parallel.pipeline_parallel_size > 1 and self.tp_rank == 0
                               and self.pp_rank == parallel.pipeline_parallel_size - 1)
        self.master_addr = master_addr
        self.master_port = master_port
        self.runner: Any = None

    def build(self, local_device_index: int | None = None) -> None:
        """Join the group (blocks until every rank has), then build this rank's shard of the engine."""
        from pagedllm.engine.builder import build_engine_parts, resolve_device
        from pagedllm.plugin_manager import get_plugin_manager

        device = resolve_device(self.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(self.rank if local_device_index is None else local_device_index)
        parallel = self.config.parallel
        init_tensor_parallel(
            self.rank,
            parallel.world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            device=device,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
        )
        pm = get_plugin_manager()
        # Plugin sections validated once; config_loaded fires in this process too.
        sections = pm.load_config(self.config)
        self.runner = build_engine_parts(self.config, pm, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                                         plugin_sections=sections).runner

    def execute(self, message: bytes) -> ModelRunnerOutput | None:
        """Run one step from rank 0's pickled (SchedulerOutput, previous output, pipelined); the step's output
        on the output rank (NOTE 4), None elsewhere."""
        scheduler_output, previous, pipelined = pickle.loads(message)
        if pipelined:  # NOTE 2
            self.runner.execute_pipelined(scheduler_output)
            return None
        adopt_tokens(self.runner, previous)
        output: ModelRunnerOutput = self.runner.execute(scheduler_output)
        return output if self.returns_output else None

    def close(self) -> None:
        """Leave the group (NOTE 3: graphs first)."""
        if self.runner is not None:
            self.runner.release_cuda_graphs()
        destroy_tensor_parallel()


def adopt_tokens(runner: Any, previous: ModelRunnerOutput | tuple[ModelRunnerOutput, ...] | None) -> None:
    """NOTE 1 / NOTE 4: the sampling rank's tokens of the last step(s) replace this runner's own (or its
    placeholders), in the order they were computed."""
    if previous is None:
        return
    states = runner.states
    for output in previous if isinstance(previous, tuple) else (previous,):
        for rid, tokens in zip(output.req_ids, output.sampled_token_ids):
            state = states.get(rid)
            if tokens and state is not None and len(state.output_token_ids) >= len(tokens):
                state.replace_last_outputs(tokens)


def encode_step(
    scheduler_output: SchedulerOutput,
    previous: ModelRunnerOutput | tuple[ModelRunnerOutput, ...] | None,
    pipelined: bool = False,
) -> bytes:
    """One pickle per step for all remote ranks (not one per rank); a pipelined step carries no `previous`."""
    message = (scheduler_output, None if pipelined else previous, pipelined)
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class Rank0Driver:
    """Rank 0's half of a model-parallel step, shared by the executors: send the step to the remote ranks
    (`_send`, the executor's transport), run rank 0's runner, and turn a failure into the executor's error
    (`_failure`: most often a peer that died inside a collective). With pipeline parallelism the step's
    output is the last stage's (NOTE 4), which the executor fetches (`_output_rank_result`)."""

    _runner: Any
    _previous: ModelRunnerOutput | None = None
    pp_size: int = 1
    _landed: tuple[ModelRunnerOutput, ...] = ()  # NOTE 4: outputs collected since the last step was sent

    @property
    def fills_deferred_masks(self) -> bool:
        """Rank 0 runs in the engine core's process and, without pipeline stages, samples for every rank: it
        fills a pipelined step's grammar masks itself (engine_core.py NOTE 2; the remote ranks get none)."""
        return self.pp_size == 1

    def _send(self, message: bytes) -> None:
        raise NotImplementedError

    def _output_rank_result(self) -> ModelRunnerOutput:
        """The output rank's output of the step just sent (NOTE 4; pipeline parallelism only)."""
        raise NotImplementedError

    def _failure(self, exc: Exception) -> Exception:
        return exc

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.pp_size > 1:
            self.launch_model(scheduler_output)
            return self.collect_model()
        self._send(encode_step(scheduler_output, self._previous))
        try:
            output: ModelRunnerOutput = self._runner.execute(scheduler_output)
        except Exception as exc:
            raise self._failure(exc) from exc
        self._previous = output
        return output

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        """Pipeline parallelism: send the step to every rank and run rank 0's (the first) stage, which
        returns once its output is on its way to the next stage; `collect_model` returns the step's output.
        Outputs come back in launch order (NOTE 4)."""
        landed, self._landed = self._landed, ()
        adopt_tokens(self._runner, landed)  # rank 0 embeds these tokens: it did not sample them
        self._send(encode_step(scheduler_output, landed))
        try:
            self._runner.execute(scheduler_output)
        except Exception as exc:
            raise self._failure(exc) from exc

    def collect_model(self) -> ModelRunnerOutput:
        """The output of the oldest launched step not yet collected (waits for the last stage)."""
        try:
            output = self._output_rank_result()
        except Exception as exc:
            raise self._failure(exc) from exc
        self._landed = (*self._landed, output)
        return output

    def execute_pipelined(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch this step on every rank; return rank 0's output of the step before (NOTE 2)."""
        self._send(encode_step(scheduler_output, None, pipelined=True))
        try:
            output: ModelRunnerOutput | None = self._runner.execute_pipelined(scheduler_output)
        except Exception as exc:
            raise self._failure(exc) from exc
        return output
