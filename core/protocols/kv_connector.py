"""The KV-connector protocol: a store of KV blocks outside the device pool, at the engine's two seams.

Modelled on vLLM V1's KVConnectorBase_V1, narrowed to what the engine calls. One object per engine serves
both sides (this increment runs scheduler and runner in one process: uniproc executor only):

- scheduler side, inside `schedule()`: `on_device_evict` hears every cached block the device pool drops
  (its KV is still intact: nothing writes a freed block before the next forward);
  `get_num_new_matched_tokens` says how many prompt tokens past the device prefix hit the store holds;
  `update_state_after_alloc` learns the blocks allocated for them; `build_connector_meta` hands the step's
  plan (saves, then loads) to the runner through `SchedulerOutput.kv_connector_metadata`.
- worker side, in the runner before the step's forward: `start_load_kv(meta)` copies the evicted blocks out
  and the hit blocks in, ordered before the forward (on CUDA a side stream the forward's stream waits for).
  vLLM's per-layer `wait_for_layer_load` / `save_kv_layer` overlap is not part of this first protocol.

Tokens a connector reports count as computed and cached for the request (`num_cached_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pagedllm.request import Request


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector's constructor receives."""

    model: str  # the model reference (a disk tier keys its files by it, with the cache layout)
    block_size: int  # tokens per block (the one KV-cache group's)
    num_blocks: int  # blocks in the device pool
    block_axis: int  # the axis of each cache tensor that indexes blocks
    device: str  # "cpu" or "cuda"
    plugin_config: Any = None  # the `plugins.<name>` section, validated by the model the connector registered


@runtime_checkable
class KVConnector(Protocol):
    """An external KV store the engine saves evicted blocks to and loads prefix hits from."""

    # -- scheduler side ----------------------------------------------------------------------------------

    def on_device_evict(self, block_hash: bytes, block_id: int) -> None:
        """The device pool is reusing `block_id`, which held the cached block `block_hash`: save it now or never.

        Called inside `schedule()`; the copy itself happens in `start_load_kv` of this step, before the
        forward overwrites the block.
        """
        ...

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens past the first `num_computed_tokens` (the device prefix hit) that this store holds.

        Whole blocks of consecutive hashes of `request.block_hashes`, starting at block
        `num_computed_tokens // block_size`; the caller keeps the total below `request.num_tokens`. Pure: a
        request that is then not admitted leaves no trace.
        """
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted with `num_external_tokens` from this store, into `block_ids` (in order)."""
        ...

    def build_connector_meta(self) -> Any:
        """The step's plan for the worker side (opaque to the engine); resets the scheduler side's pending state."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since start (hit tokens per tier, bytes moved, ...), for the engine stats and /metrics."""
        ...

    # -- worker side -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The device cache tensors, one per layer (layers sharing a tensor list it more than once)."""
        ...

    def start_load_kv(self, metadata: Any) -> None:
        """Run the step's saves, then its loads, before the forward reads or writes the cache."""
        ...
