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

Optional members (API 1.5; the engine asks with `getattr`, a connector without them keeps working):

- `request_finished(request, block_ids)`: a request ended (stopped, length-capped or aborted) and its blocks
  are about to go back to the pool. Called inside the scheduler's update after the step that computed them,
  so their KV is complete and nothing has overwritten it yet. A disaggregated-prefill producer copies the
  prompt's blocks out here (vLLM's `request_finished`, without its delayed free: the copy is made now).
- Asynchronous loads (`KVConnectorAsyncLoad`): `get_num_new_matched_tokens` may answer `(tokens, True)`
  (vLLM's `load_kv_async`) for a hit it fetches in the background (a disk read, a transfer). The scheduler
  then allocates the request's blocks without registering them in the prefix cache, parks the request
  outside the batch (RequestStatus.WAITING_FOR_REMOTE_KVS) and asks `get_finished_loads()` at each step;
  a request it names resumes as a running prefill past the tokens it says arrived intact, and the copies
  into its blocks must be in the plan of that step (before its forward). A plain `int` answer, or
  `(tokens, False)`, is a synchronous hit as before. A policy that does not park (it calls
  `external_prefix_hit`) treats an asynchronous hit as a miss, never as loaded KV.
- `shutdown()`: the engine is shutting down (the runner's release): finish or drop queued I/O, stop threads.
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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | tuple[int, bool]:
        """Prompt tokens past the first `num_computed_tokens` (the device prefix hit) that this store holds;
        or `(tokens, load_async)`, where `load_async` says they arrive in the background (module docstring).

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


@runtime_checkable
class KVConnectorRequestHook(Protocol):
    """The optional per-request member (API 1.5): a connector that has it hears every request's end."""

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """`request` finished (its status says how); `block_ids` are its blocks of KV-cache group 0, in order.

        Runs before the blocks are freed: a copy made here reads the request's complete KV. Must not keep
        references to the blocks themselves (they are reused as soon as this returns).
        """
        ...


@runtime_checkable
class KVConnectorAsyncLoad(Protocol):
    """The optional asynchronous-load member (API 1.5): needed by a connector that answers `(tokens, True)`."""

    def get_finished_loads(self, wait: bool = False) -> dict[str, int]:
        """Parked requests whose loads are done since the last call: request id -> tokens loaded intact.

        Tokens are whole blocks from where the hit started, at most what the hit promised; fewer means the
        blocks after them failed (a corrupt file, a lost transfer) and are recomputed. Copies of what arrived
        go into the plan `build_connector_meta` returns next. `wait`: the engine has nothing else to run, so
        the connector may block briefly for a load instead of being polled in a busy loop.
        """
        ...
