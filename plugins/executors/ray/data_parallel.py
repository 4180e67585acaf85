"""Data parallelism on Ray: N engine replicas as Ray actors behind one frontend and one balancer.

    frontend (DataParallelLLMEngine)            replica i (EngineReplica actor, placement group i)
    ────────────────────────────────            ─────────────────────────────────────────────────
    add_request ─ balancer.pick ─ queue[i]
    step(): one call in flight per busy   ──▶   add queued requests, apply aborts, core.step()
            replica; take the first answer ◀──   EngineCoreOutputs (rank 0's; its tp ranks in bundles 1..)
    a replica whose call fails (actor
    died, worker died) is marked unhealthy:
    its requests finish with an error

Each replica is a whole engine (scheduler, KV cache, tp ranks); replicas share nothing, so a dead replica
costs only the requests it held. The balancer (pagedllm.distributed.load_balancer) routes by prefix-cache
affinity within a load slack.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm.api.executor import NoHealthyReplicaError, ReplicaBalancer
from pagedllm.api.sched import EngineCoreOutput, Request, SchedulerStats
from pagedllm.plugins.executors.ray.executor import ensure_ray, ray_options

logger = logging.getLogger("pagedllm")


class EngineReplica:
    """One data-parallel replica: a whole EngineCore in a Ray actor."""

    def __init__(self, config_dict: dict[str, Any]) -> None:
        from pagedllm.api.engine import EngineConfig, EngineCore, build_engine, get_plugin_manager

        config = EngineConfig.model_validate(config_dict)
        pm = get_plugin_manager()
        sections = pm.load_config(config)
        self.parts = build_engine(config, pm, plugin_sections=sections)
        self.core = EngineCore(self.parts, pm)

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "max_model_len": self.parts.max_model_len,
                "num_blocks": self.parts.num_blocks, "block_size": self.parts.block_size}

    def step(self, new_requests: list[Request], aborts: list[str]) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        """Admit, abort, run one step; also the stats after it (one round trip per step)."""
        outputs = []
        for request in new_requests:
            try:
                self.core.add_request(request)
            except Exception as exc:  # e.g. a duplicate id: that request fails, not the replica
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="error", error=str(exc)))
        if aborts:
            self.core.abort_requests(aborts)
        if self.core.has_unfinished_requests():
            outputs.extend(self.core.step())
        return outputs, self.core.get_stats()

    def shutdown(self) -> None:
        self.core.shutdown()


class RayDataParallelCore:
    """The EngineCore surface (add_request, abort_requests, step, ...) over N replica actors."""

    def __init__(self, config: Any) -> None:
        ray = ensure_ray(ray_options(config))
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedllm.api.engine import resolve_device

        parallel = config.parallel
        dp = parallel.data_parallel_size
        tp = parallel.tensor_parallel_size * parallel.pipeline_parallel_size  # every rank of a replica
        gpu = resolve_device(config.device).type == "cuda"
        # A replica is a one-replica engine; its tp x pp ranks (if any) are Ray actors in the replica's group.
        replica_config = config.model_copy(deep=True)
        replica_config.parallel.data_parallel_size = 1
        replica_config.parallel.executor = "ray" if tp > 1 else None
        config_dict = replica_config.model_dump()
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.groups = [placement_group([bundle] * tp, strategy="PACK") for _ in range(dp)]
        ray.get([g.ready() for g in self.groups])
        actor_cls = ray.remote(EngineReplica)
        self.replicas = [
            actor_cls.options(
                num_cpus=1, num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
                ),
            ).remote(config_dict)
            for group in self.groups
        ]
        try:
            self.info = ray.get([r.describe.remote() for r in self.replicas])
        except Exception:
            self.shutdown()
            raise
        self.max_model_len = min(i["max_model_len"] for i in self.info)
        self.balancer = ReplicaBalancer(dp, config.kv_cache.block_size, ray_options(config).affinity_slack)
        self.owner: dict[str, int] = {}  # in-flight request id -> replica
        self.served = [0] * dp  # requests each replica finished (tests and logs)
        self.dead_reasons: dict[int, str] = {}
        self._new: list[list[Request]] = [[] for _ in range(dp)]
        self._aborts: list[list[str]] = [[] for _ in range(dp)]
        self._calls: dict[int, Any] = {}  # replica -> its in-flight step call
        self._errors: list[EngineCoreOutput] = []
        self._stats = [SchedulerStats() for _ in range(dp)]
        self._ray = ray

    # -- the EngineCore surface -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        try:
            replica = self.balancer.pick(request.prompt_token_ids)
        except NoHealthyReplicaError as exc:
            reasons = "; ".join(f"replica {i}: {r}" for i, r in sorted(self.dead_reasons.items()))
            self._errors.append(self._error(request.request_id, f"{exc} ({reasons})"))
            return
        self.owner[request.request_id] = replica
        self._new[replica].append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            replica = self.owner.pop(rid, None)
            if replica is not None:
                self._aborts[replica].append(rid)
                self.balancer.finished(replica)

    def has_unfinished_requests(self) -> bool:
        return bool(self._errors or self.owner)

    def step(self) -> list[EngineCoreOutput]:
        """Start a step on every replica with work and none in flight; return the outputs of those that answer
        first (waits for at least one)."""
        outputs, self._errors = self._errors, []
        for i, replica in enumerate(self.replicas):
            if i in self._calls or not self.balancer.healthy[i]:
                continue
            if self._new[i] or self._aborts[i] or self.balancer.load[i]:
                self._calls[i] = replica.step.remote(self._new[i], self._aborts[i])
                self._new[i], self._aborts[i] = [], []
        if not self._calls:
            return outputs
        by_ref = {ref: i for i, ref in self._calls.items()}
        done, _ = self._ray.wait(list(by_ref), num_returns=1)
        done, _ = self._ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)  # and any others ready
        for ref in done:
            i = by_ref[ref]
            del self._calls[i]
            try:
                replica_outputs, self._stats[i] = self._ray.get(ref)
            except Exception as exc:
                outputs.extend(self._fail_replica(i, exc))
                continue
            for out in replica_outputs:
                if out.finished and self.owner.pop(out.request_id, None) is not None:
                    self.balancer.finished(i)
                    self.served[i] += 1
            outputs.extend(replica_outputs)
        return outputs

    def get_stats(self) -> SchedulerStats:
        """The healthy replicas' counters summed (KV usage averaged)."""
        alive = [s for i, s in enumerate(self._stats) if self.balancer.healthy[i]] or [SchedulerStats()]
        total = SchedulerStats()
        for s in alive:
            total.num_running += s.num_running
            total.num_waiting += s.num_waiting
            total.num_preemptions += s.num_preemptions
            total.prefix_cache_queries += s.prefix_cache_queries
            total.prefix_cache_hits += s.prefix_cache_hits
            total.num_steps += s.num_steps
        total.kv_cache_usage = sum(s.kv_cache_usage for s in alive) / len(alive)
        return total

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():  # the cluster is gone, and the replicas with it
            return
        for replica in getattr(self, "replicas", []):
            try:
                ray.get(replica.shutdown.remote(), timeout=30)
            except Exception as exc:  # a dead replica: nothing to stop
                logger.debug("replica shutdown: %s", exc)
            ray.kill(replica)
        for group in getattr(self, "groups", []):
            ray.util.remove_placement_group(group)
        self.replicas, self.groups = [], []

    # -- failures -------------------------------------------------------------------------------------

    def _fail_replica(self, replica: int, exc: Exception) -> list[EngineCoreOutput]:
        """Mark the replica unhealthy and finish every request it held with an error naming why."""
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.dead_reasons[replica] = reason
        self.balancer.mark_unhealthy(replica)
        logger.error("data-parallel replica %d failed (%s); its requests fail, the others keep serving",
                     replica, reason)
        lost = [rid for rid, owner in self.owner.items() if owner == replica]
        for rid in lost:
            del self.owner[rid]
        self._new[replica], self._aborts[replica] = [], []
        return [self._error(rid, f"data-parallel replica {replica} failed: {reason}") for rid in lost]

    @staticmethod
    def _error(request_id: str, message: str) -> EngineCoreOutput:
        return EngineCoreOutput(request_id, [], finish_reason="error", error=message)
