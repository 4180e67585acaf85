"""RayExecutor: tensor-parallel ranks 1..N-1 as Ray actors; rank 0 is the engine core's process.

Placement: inside a data-parallel replica (ray/data_parallel.py) the replica actor sits in bundle 0 of its replica's
placement group and the ranks take bundles 1..N-1, so a replica's ranks are reserved together and a
replica's failure stays inside its group. Anywhere else the executor reserves its own group of N-1 bundles.
PACK keeps the ranks on one node when one has room (NVLink / loopback); the rendezvous address is rank 0's
node IP, so ranks on several nodes also meet.

Steps go as in the multiproc executor (one pickle of (SchedulerOutput, rank 0's previous output), every rank
runs, rank 0's output returned; pipelined steps without the previous output), through one `ray.put` and an
actor call per rank. Actor calls from one caller run in the order they were made.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from pagedllm.api.executor import (
    ExecutorContext,
    Rank0Driver,
    TPWorker,
    WorkerDiedError,
    destroy_tensor_parallel,
    free_port,
    init_tensor_parallel,
)
from pagedllm.api.sched import ModelRunnerOutput
from pagedllm.plugins.executors.ray import RayOptions

logger = logging.getLogger("pagedllm")


def ensure_ray(options: RayOptions) -> Any:
    """The `ray` module, connected: to `options.address`, else the cluster already joined, else a local one."""
    import ray

    if not ray.is_initialized():
        ray.init(address=options.address, include_dashboard=False, log_to_driver=False)
    return ray


def ray_options(config: Any) -> RayOptions:
    return RayOptions.model_validate(config.plugins.get("ray", {}))


class TPWorkerActor:
    """The Ray actor around one TPWorker (Ray needs a plain class; the worker does the work)."""

    def __init__(self, config_dict: dict[str, Any], rank: int, master_addr: str, master_port: int) -> None:
        self.worker = TPWorker(config_dict, rank, master_addr, master_port)

    def build(self, local_device_index: int | None) -> int:
        import os

        self.worker.build(local_device_index)
        return os.getpid()

    def execute(self, message: bytes) -> None:
        self.worker.execute(message)

    def close(self) -> None:
        self.worker.close()


class RayExecutor(Rank0Driver):
    def __init__(self, ctx: ExecutorContext) -> None:
        self.config = ctx.config
        self.tp_size = ctx.tp_size
        self.options = ray_options(ctx.config)
        self._workers: list[Any] = []
        self._pending: list[Any] = []
        self._build_refs: list[Any] = []
        self._own_group: Any = None
        self._runner: Any = None
        self._previous: ModelRunnerOutput | None = None
        self._closed = False

    @classmethod
    def data_parallel_core(cls, config: Any) -> Any:
        """N engine replicas behind one balancer (the DataParallelLLMEngine's core)."""
        from pagedllm.plugins.executors.ray.data_parallel import RayDataParallelCore

        return RayDataParallelCore(config)

    def start(self) -> None:
        from pagedllm.api.engine import resolve_device

        if self.tp_size == 1:
            return
        ray = ensure_ray(self.options)
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        device = resolve_device(self.config.device)
        gpu = device.type == "cuda"
        group = get_current_placement_group()
        if group is not None and len(group.bundle_specs) >= self.tp_size:
            first_bundle = 1  # a replica's group: bundle 0 is this process (the replica actor)
        else:
            resource = {"GPU": 1} if gpu else {"CPU": 1}
            group = self._own_group = placement_group([resource] * (self.tp_size - 1), strategy="PACK")
            ray.get(group.ready())
            first_bundle = 0
        addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        actor_cls = ray.remote(TPWorkerActor)
        config_dict = self.config.model_dump()
        for rank in range(1, self.tp_size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first_bundle + rank - 1)
            worker = actor_cls.options(
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy
            ).remote(config_dict, rank, addr, port)
            self._workers.append(worker)
            # Ray gives a GPU actor exactly its own device (CUDA_VISIBLE_DEVICES): local index 0.
            self._build_refs.append(worker.build.remote(0 if gpu else None))
        init_tensor_parallel(0, self.tp_size, master_addr=addr, master_port=port, device=device)

    def bind(self, runner: Any) -> None:
        self._runner = runner
        if not self._workers:  # tp 1: no hop
            self.execute_model = runner.execute  # type: ignore[method-assign]
            self.execute_pipelined = runner.execute_pipelined  # type: ignore[method-assign]
            return
        import ray

        for rank, ref in enumerate(self._build_refs, start=1):
            try:
                ray.get(ref)
            except Exception as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} (Ray actor) failed to build its shard: {exc}") from exc

    def _send(self, message: bytes) -> None:
        import ray

        self.check_health()
        ref = ray.put(message)
        self._pending = [w.execute.remote(ref) for w in self._workers]

    def check_health(self, wait_s: float = 0.0) -> None:
        """Raise WorkerDiedError if a rank's last step failed (a dead actor fails its calls)."""
        if not self._pending:
            return
        import ray

        done, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=wait_s)
        for rank, ref in enumerate(self._pending, start=1):
            if ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    raise WorkerDiedError(f"tensor-parallel rank {rank} (Ray actor) failed: {exc}") from exc

    def _failure(self, exc: Exception) -> Exception:
        try:
            self.check_health(wait_s=1.0)
        except WorkerDiedError as died:
            return WorkerDiedError(f"tensor-parallel step failed ({type(exc).__name__}: {exc}); {died}")
        return exc

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._workers:
            import ray

            # Every rank leaves the group at once (NCCL's teardown waits for all, and for every CUDA graph
            # holding its collectives: cuda_graphs.py NOTE 5), then the actors go.
            closing = [w.close.remote() for w in self._workers]
            if self._runner is not None:
                self._runner.release_cuda_graphs()
            destroy_tensor_parallel(timeout_s=10.0)
            with contextlib.suppress(Exception):
                ray.get(closing, timeout=10)
            for worker in self._workers:
                try:
                    ray.kill(worker)
                except Exception as exc:  # already gone
                    logger.debug("ray.kill: %s", exc)
            if self._own_group is not None:
                ray.util.remove_placement_group(self._own_group)
        self._runner = None
