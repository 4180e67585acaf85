"""TPWorker: one remote tensor-parallel rank (1..N-1) of an engine replica, wherever it runs.

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
        init_tensor_parallel(
            self.rank,
            self.config.parallel.tensor_parallel_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            device=device,
        )
        pm = get_plugin_manager()
        # Plugin sections validated once; config_loaded fires in this process too.
        sections = pm.load_config(self.config)
        self.runner = build_engine_parts(self.config, pm, tp_rank=self.rank, plugin_sections=sections).runner

    def execute(self, message: bytes) -> None:
        """Run one step from rank 0's pickled (SchedulerOutput, rank 0's previous output, pipelined)."""
        scheduler_output, previous, pipelined = pickle.loads(message)
        if pipelined:  # NOTE 2
            self.runner.execute_pipelined(scheduler_output)
            return
        self._adopt_tokens(previous)
        self.runner.execute(scheduler_output)

    def _adopt_tokens(self, previous: ModelRunnerOutput | None) -> None:
        """NOTE 1: rank 0's tokens of the last step replace ours."""
        if previous is None:
            return
        states = self.runner.states
        for rid, tokens in zip(previous.req_ids, previous.sampled_token_ids):
            state = states.get(rid)
            if tokens and state is not None and len(state.output_token_ids) >= len(tokens):
                state.replace_last_outputs(tokens)

    def close(self) -> None:
        """Leave the group (NOTE 3: graphs first)."""
        if self.runner is not None:
            self.runner.release_cuda_graphs()
        destroy_tensor_parallel()


def encode_step(
    scheduler_output: SchedulerOutput, previous: ModelRunnerOutput | None, pipelined: bool = False
) -> bytes:
    """One pickle per step for all remote ranks (not one per rank); a pipelined step carries no `previous`."""
    message = (scheduler_output, None if pipelined else previous, pipelined)
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class Rank0Driver:
    """Rank 0's half of a tensor-parallel step, shared by the executors: send the step to the remote ranks
    (`_send`, the executor's transport), run rank 0's runner, and turn a failure into the executor's error
    (`_failure`: most often a peer that died inside a collective)."""

    _runner: Any
    _previous: ModelRunnerOutput | None = None

    def _send(self, message: bytes) -> None:
        raise NotImplementedError

    def _failure(self, exc: Exception) -> Exception:
        return exc

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send(encode_step(scheduler_output, self._previous))
        try:
            output: ModelRunnerOutput = self._runner.execute(scheduler_output)
        except Exception as exc:
            raise self._failure(exc) from exc
        self._previous = output
        return output

    def execute_pipelined(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch this step on every rank; return rank 0's output of the step before (NOTE 2)."""
        self._send(encode_step(scheduler_output, None, pipelined=True))
        try:
            output: ModelRunnerOutput | None = self._runner.execute_pipelined(scheduler_output)
        except Exception as exc:
            raise self._failure(exc) from exc
        return output
