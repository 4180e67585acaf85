"""pagedllm.api.executor: What an executor plugin builds on: its context, the tensor-parallel worker and driver, process groups.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.distributed.load_balancer import NoHealthyReplicaError, ReplicaBalancer
from pagedllm.distributed.parallel_state import destroy_tensor_parallel, free_port, init_tensor_parallel
from pagedllm.executor.tp_worker import Rank0Driver, TPWorker
from pagedllm.protocols.executor import ExecutorContext, WorkerDiedError

__all__ = [
    "ExecutorContext",
    "NoHealthyReplicaError",
    "Rank0Driver",
    "ReplicaBalancer",
    "TPWorker",
    "WorkerDiedError",
    "destroy_tensor_parallel",
    "free_port",
    "init_tensor_parallel",
]
