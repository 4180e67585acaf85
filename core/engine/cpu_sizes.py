"""A CPU engine's batch limits and KV-cache size resolved into its config, between loading the weights and
planning the cache (builder.py): platform/cpu_sizing.py decides, from the machine and the model, whatever the
config leaves unset.

It runs after the weights are loaded so the memory it reads is what is left with them in place (a GGUF model's
bf16 copy included), and before the KV plan, the scheduler and the runner, which all take the resolved config.
It also sets glibc malloc's thresholds for the engine's per-step tensors (platform/cpu_malloc.py), once per
process, and adds that line to the reasons.
"""

from __future__ import annotations

import itertools
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed.communication import world_min
from pagedllm.engine.kv_plan import kv_layout
from pagedllm.kv_cache.capacity import KVCapacity
from pagedllm.platform.cpu_features import cpu_features
from pagedllm.platform.cpu_malloc import tune_malloc
from pagedllm.platform.cpu_sizing import CpuSizingInputs, RequestedSizes, size_cpu_engine
from pagedllm.platform.host_memory import host_memory


def resolve_cpu_sizes(config: EngineConfig, model: Any, trained_len: int | None) -> tuple[EngineConfig, tuple[str, ...]]:
    """The config with `scheduler.max_num_seqs`, `scheduler.max_num_batched_tokens` and `kv_cache.memory_gb`
    sized for this machine where it left them unset, and the reasons (one line each). Raises CpuSizingError
    (a ValueError naming the key) for a KV size that cannot fit in the memory available."""
    _specs, layout = kv_layout(config, model)
    sched, kv = config.scheduler, config.kv_cache
    requested = RequestedSizes(
        max_num_seqs=sched.max_num_seqs if "max_num_seqs" in sched.model_fields_set else None,
        max_num_batched_tokens=(sched.max_num_batched_tokens if "max_num_batched_tokens" in sched.model_fields_set
                                else None),
        memory_gb=kv.memory_gb if "memory_gb" in kv.model_fields_set else None,
        num_blocks=kv.num_blocks,
    )

    def blocks_per_request(num_tokens: int, chunk: int) -> int:
        return KVCapacity(layout, 0, chunk).blocks_per_request(num_tokens)

    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    sizing = size_cpu_engine(CpuSizingInputs(
        physical_cores=cpu_features().physical_cores,
        memory=host_memory(),
        weights_bytes=weights,
        bytes_per_block=layout.bytes_per_block,
        blocks_per_request=blocks_per_request,
        max_model_len=config.max_model_len or trained_len or 2048,  # kv_plan.py's model_max
        requested=requested,
    ))
    # Every rank builds its runner for these sizes and its memory may differ: all take the smallest.
    seqs, budget = world_min(sizing.max_num_seqs), world_min(sizing.max_num_batched_tokens)
    reasons = sizing.reasons
    malloc = tune_malloc()  # a step's tensors reuse the heap's pages (platform/cpu_malloc.py NOTE 1)
    if malloc is not None:
        reasons += (malloc,)
    if (seqs, budget) != (sizing.max_num_seqs, sizing.max_num_batched_tokens):
        reasons += (f"max_num_seqs {seqs}, max_num_batched_tokens {budget}: the smallest over the ranks",)
    kv_update: dict[str, Any] = {}
    if sizing.kv_bytes is not None and requested.memory_gb is None:
        kv_update["memory_gb"] = sizing.kv_bytes / (1 << 30)
    resolved = config.model_copy(update={
        "scheduler": sched.model_copy(update={"max_num_seqs": seqs, "max_num_batched_tokens": budget}),
        "kv_cache": kv.model_copy(update=kv_update),
    })
    return resolved, reasons
