"""RayExecutor: tensor-parallel ranks 1..N-1 as Ray actors; rank 0 is the engine core's process.

Placement: inside a data-parallel replica (ray/data_parallel.py) the replica actor sits in bundle 0 of its replica's
placement group and the ranks take bundles 1..N-1, so a replica's ranks are reserved together and a
replica's failure stays inside its group. Anywhere else the executor reserves its own group of N-1 bundles.
PACK keeps the ranks on one node when one has room (NVLink / loopback); the rendezvous address is rank 0's
node IP, so ranks on several nodes also meet.

Steps go as in the multiproc executor (one pickle of (SchedulerOutput, rank 0's previous output), every rank
runs, rank 0's output returned; pipelined steps without the previous output), through one `ray.put` and an
actor call per rank. Actor calls from one caller run in the order they were made.

NOTE 1: a dead actor fails every call made to it, pending ones included, so a rank's death shows as a failed
ref: the last step's calls are checked before each step (and after a failed one, a collective whose peer is
gone); while the engine is idle there are no calls in flight, so `check_health` (which the engine core calls
every second when idle) sends each rank a `ping` and reads the answer the next time. Death is thus found
within about a second at rest, at the next step under load.
NOTE 2: a monitor thread (as vLLM's Ray executor polls its workers' refs) waits on the same refs from `bind` on
and calls the failure callback the moment one fails, even while rank 0 is inside a step: the engine core's
watchdog ends a step that a dead peer would otherwise hold in an NCCL collective (engine/rank_watchdog.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
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

    def execute(self, message: bytes) -> Any:
        """The step's output on the last pipeline stage's output rank, None elsewhere (tp_worker.py NOTE 4)."""
        return self.worker.execute(message)

    def ping(self) -> None:
        """NOTE 1: answered at once by a live actor; a dead one's ref fails."""

    def close(self) -> None:
        self.worker.close()


class RayExecutor(Rank0Driver):
    def __init__(self, ctx: ExecutorContext) -> None:
        self.config = ctx.config
        self.tp_size = ctx.tp_size
        self.pp_size = ctx.pp_size
        self.world_size = ctx.world_size  # ranks 1..world_size-1 are actors (tp x pp, global rank order)
        self.options = ray_options(ctx.config)
        self._workers: list[Any] = []
        self._pending: list[Any] = []  # the last step's call per rank
        self._outputs: deque[Any] = deque()  # pipeline parallelism: the output rank's calls, oldest first
        self._pings: list[Any] = []  # NOTE 1: the idle liveness probe per rank
        self._dead = False
        self._failure_callback: Callable[[str], None] | None = None
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

        if self.world_size == 1:
            return
        ray = ensure_ray(self.options)
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        device = resolve_device(self.config.device)
        gpu = device.type == "cuda"
        group = get_current_placement_group()
        if group is not None and len(group.bundle_specs) >= self.world_size:
            first_bundle = 1  # a replica's group: bundle 0 is this process (the replica actor)
        else:
            resource = {"GPU": 1} if gpu else {"CPU": 1}
            group = self._own_group = placement_group([resource] * (self.world_size - 1), strategy="PACK")
            ray.get(group.ready())
            first_bundle = 0
        addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        actor_cls = ray.remote(TPWorkerActor)
        config_dict = self.config.model_dump()
        for rank in range(1, self.world_size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first_bundle + rank - 1)
            worker = actor_cls.options(
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy
            ).remote(config_dict, rank, addr, port)
            self._workers.append(worker)
            # Ray gives a GPU actor exactly its own device (CUDA_VISIBLE_DEVICES): local index 0.
            self._build_refs.append(worker.build.remote(0 if gpu else None))
        init_tensor_parallel(0, self.world_size, master_addr=addr, master_port=port, device=device,
                             pipeline_parallel_size=self.pp_size)

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
        threading.Thread(target=self._monitor, name="pagedllm-ray-monitor", daemon=True).start()

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._failure_callback = callback

    def _monitor(self) -> None:
        """NOTE 2: poll the in-flight refs (timeouts, not one blocking wait: Ray's teardown must not find a
        thread blocked inside it); on the first failure, unless we are shutting down, tell the callback."""
        import ray

        while not self._closed:
            pending, pings = self._pending, self._pings  # the loop thread replaces the lists, never edits them
            refs = [*pending, *pings]
            try:
                self._raise_if_failed(pending, wait_s=0.5)
                self._raise_if_failed(pings)
            except WorkerDiedError as died:
                callback = self._failure_callback
                if not self._closed and callback is not None:
                    callback(str(died))
                return
            except Exception:  # Ray itself going away
                return
            if not refs or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs):
                time.sleep(0.5)  # nothing in flight to wait on

    def _send(self, message: bytes) -> None:
        import ray

        self._raise_if_failed(self._pending)
        self._raise_if_failed(self._pings)
        self._pings = []  # read: the step's own calls are the probe from here on (NOTE 1)
        ref = ray.put(message)
        self._pending = [w.execute.remote(ref) for w in self._workers]
        if self.pp_size > 1:  # the last stage's tp rank 0 returns the step's output (tp_worker.py NOTE 4)
            self._outputs.append(self._pending[self.world_size - self.tp_size - 1])

    def _output_rank_result(self) -> ModelRunnerOutput:
        """The last pipeline stage's output of this step: its tensor-parallel rank 0's call returns it."""
        import ray

        output: ModelRunnerOutput = ray.get(self._outputs.popleft())
        return output

    def check_health(self) -> None:
        """Raise WorkerDiedError if a rank is gone: its last step's call or its last ping failed (NOTE 1)."""
        if not self._workers:
            return
        import ray

        self._raise_if_failed(self._pending)
        if self._pings:
            self._raise_if_failed(self._pings)
            answered, _ = ray.wait(self._pings, num_returns=len(self._pings), timeout=0)
            if len(answered) < len(self._pings):
                return  # still on its way (behind a step's call, or the actor is busy): read it next time
        self._pings = [w.ping.remote() for w in self._workers]

    def _raise_if_failed(self, refs: list[Any], wait_s: float = 0.0) -> None:
        """WorkerDiedError for the first of `refs` (one per rank) that failed, waiting up to `wait_s` for one."""
        if not refs:
            return
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs, start=1)}
        rest, deadline = list(refs), time.monotonic() + wait_s
        while rest:
            done, rest = ray.wait(rest, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                return
            try:
                ray.get(done[0])
            except Exception as exc:
                self._dead = True
                # Ray's message runs to a paragraph of possible causes; its first line says what happened.
                what = (str(exc).strip().splitlines() or [""])[0]
                raise WorkerDiedError(
                    f"tensor-parallel rank {rank_of[done[0]]} (Ray actor) failed: {type(exc).__name__}: {what}"
                ) from exc

    def _failure(self, exc: Exception) -> Exception:
        """Rank 0's step failed, most often in a collective whose peer died: the dead actor's call fails as soon
        as Ray has seen the process go (well under a second on one node; up to 5 s allowed)."""
        try:
            self._raise_if_failed(self._pending, wait_s=5.0)
        except WorkerDiedError as died:
            return WorkerDiedError(f"{died} (during a step: {type(exc).__name__}: {exc})")
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
            # A dead rank never leaves the group: do not wait the full teardown for it.
            destroy_tensor_parallel(timeout_s=1.0 if self._dead else 10.0)
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
