"""This process's place in the model-parallel groups: tensor-parallel and pipeline-parallel rank and size.

One engine replica with tensor_parallel_size N runs N processes, one per rank; every rank holds 1/N of each
sharded weight and of each KV head set, and the ranks meet in collectives after row-parallel layers and the
LM head. The group is the default torch.distributed group of those processes:

    backend   NCCL when the rank's device is CUDA, gloo on the CPU (so CI can run it)
    rendezvous tcp://MASTER_ADDR:MASTER_PORT (loopback for local workers), or torchrun's env:// variables

NOTE 1: NCCL_NVLS_ENABLE=0 is set before NCCL is initialised: NVLink SHARP (multicast) allocations can take
a shared host's GPUs out of service, and the all-reduces of a replica this size do not need it.
NOTE 2: one process holds at most one tensor-parallel group (the default group), so an engine with tp > 1
owns its process's torch.distributed state; `destroy_tensor_parallel` hands it back when the engine stops.
When no group was initialised the process is rank 0 of 1 and every collective is the identity.

NOTE 4 (pipeline parallelism): with pipeline_parallel_size P the world is P stages of tp_size ranks each,
numbered stage-major as in vLLM: global rank = pp_rank * tp_size + tp_rank. Each stage's ranks form their
own tensor-parallel subgroup (the layers' all-reduces stay inside a stage); rank (s, t) sends its stage's
output to (s + 1, t). At P = 1 the tensor-parallel group is the default group, exactly as before.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("pagedllm")

# Long enough for a first step that compiles kernels on one rank while another waits in its collective;
# short enough that a rank whose peer died mid-collective reports it instead of hanging for gloo's 30 min.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ParallelState:
    """The tensor- and pipeline-parallel coordinates of this process (NOTE 4)."""

    tp_rank: int = 0
    tp_size: int = 1
    backend: str | None = None  # None: no process group (world size 1)
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # this stage's subgroup; None: the default group (pp_size 1)

    @property
    def rank(self) -> int:
        """The global rank (NOTE 4)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    """This process's rank and group size (rank 0 of 1 until `init_tensor_parallel` ran)."""
    return _STATE


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def get_pp_rank() -> int:
    return _STATE.pp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def default_backend(device: torch.device | str) -> str:
    """NCCL for CUDA ranks, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pipeline_parallel_size: int = 1,
) -> ParallelState:
    """Join the model-parallel group; blocks until all `world_size` ranks have joined.

    Arguments left out come from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    A world size of 1 creates no process group. `world_size` counts every rank: tp_size x
    `pipeline_parallel_size` (NOTE 4).
    """
    global _STATE
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    pp = pipeline_parallel_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel: rank {rank} is not in a group of {world_size}")
    if pp < 1 or world_size % pp:
        raise ValueError(f"pipeline parallel: {pp} stages do not divide a world of {world_size} ranks")
    if world_size == 1:
        _STATE = ParallelState()
        return _STATE
    if dist.is_initialized():
        raise RuntimeError(
            "tensor parallel: this process already belongs to a torch.distributed group; one engine with "
            "tensor_parallel_size > 1 per process (stop the other engine first)"
        )
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NOTE 1
    backend = backend or default_backend(device)
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = master_port or int(os.environ.get("MASTER_PORT", 0))
    if not port:
        raise ValueError("tensor parallel: no rendezvous port (pass master_port or set MASTER_PORT)")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp_size = world_size // pp
    tp_group = None
    if pp > 1:
        # Every rank creates every stage's subgroup, in the same order (torch.distributed's rule for new_group).
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), backend=backend)
            if stage == rank // tp_size:
                tp_group = group
    _STATE = ParallelState(rank % tp_size, tp_size, backend, rank // tp_size, pp, tp_group)
    return _STATE


def destroy_tensor_parallel(timeout_s: float = 30.0) -> None:
    """Leave the group (NOTE 2); safe to call when none was joined.

    NOTE 3: NCCL's communicator teardown waits for the other ranks to tear down theirs, so every rank must
    call this at about the same time (an executor tells its workers to stop, then calls it, then joins them),
    and it also waits for every CUDA graph that captured the group's collectives: callers destroy theirs
    first (cuda_graphs.py NOTE 5; with them alive this timed out on every rank and the process aborted at exit).
    If a rank is already dead it would wait forever: after `timeout_s` the teardown is left running in the
    background and this process stays in the group (a warning says so), rather than hang the caller.
    """
    global _STATE
    if _STATE.world_size > 1 and dist.is_initialized():
        done = threading.Event()

        def destroy() -> None:
            dist.destroy_process_group()
            done.set()

        threading.Thread(target=destroy, name="pagedllm-tp-destroy", daemon=True).start()
        if not done.wait(timeout_s):
            logger.warning("tensor parallel: leaving the process group did not finish in %.0fs (a rank is gone?)",
                           timeout_s)
    _STATE = ParallelState()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for the rendezvous (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
