"""Several KV connectors as one (vLLM's MultiConnector): `kv_transfer.kv_connector: [tiered, pd]`.

The engine keeps one connector object; with a list it is this stack, which forwards each call to the
connectors in the configured order:

- every connector hears every device eviction, registers the cache tensors, runs its own part of each step's
  plan (the stack's plan is the list of theirs) and reports its counters (summed where two use one name);
- every connector is asked for a request's prefix hit, the longest answer wins (the earlier in the list on a
  tie, so put the cheaper store first), and only the winner learns of the admission. vLLM's MultiConnector
  takes the first non-empty answer instead; a short hit in a small first store would then hide a whole
  prefix in the next one. Asking is pure (protocols/kv_connector.py), so the losers keep no state;
- the optional members (protocols/kv_connector.py: request_finished, get_finished_loads, shutdown) reach the
  connectors that have them.

NOTE (one loading connector a step): a connector's plan saves the blocks this step evicts and loads hits into
blocks this step allocates -- possibly the same blocks, which is safe inside one plan (its saves come first)
but not across two: connector A's load into an evicted block, run before connector B's save of it, would
hand B the wrong KV. The plans are opaque to the stack, so it lets one connector load per step (the first
whose background loads finished, else the first chosen for a hit), runs that one's plan last, and asks only
that one about further hits in the step: a hit another connector holds is recomputed instead (no token changes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedllm.request import Request


class ConnectorStack:
    def __init__(self, connectors: list[Any]) -> None:
        if len(connectors) < 2:
            raise ValueError("a connector stack holds two or more connectors")
        self.connectors = connectors
        self._chosen: dict[str, int] = {}  # request id -> the connector whose hit it was asked about last
        self._loader: int | None = None  # this step's loading connector (NOTE)

    # -- scheduler side ----------------------------------------------------------------------------------

    def on_device_evict(self, block_hash: bytes, block_id: int) -> None:
        for connector in self.connectors:
            connector.on_device_evict(block_hash, block_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        best: tuple[int, bool] = (0, False)
        self._chosen.pop(request.request_id, None)
        for i, connector in enumerate(self.connectors):
            if self._loader is not None and i != self._loader:
                continue  # NOTE: one loading connector a step
            answer = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            found, load_async = answer if isinstance(answer, tuple) else (answer, False)
            if found > best[0]:
                best = (found, load_async)
                self._chosen[request.request_id] = i
        return best

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        if chosen is not None:
            self._loader = chosen
            self.connectors[chosen].update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self) -> tuple[list[int], list[Any]] | None:
        """(the order to run the plans in: the loading connector's last, NOTE), the plans."""
        metas = [connector.build_connector_meta() for connector in self.connectors]
        loader, self._loader = self._loader, None
        order = [i for i in range(len(metas)) if i != loader] + ([loader] if loader is not None else [])
        return (order, metas) if any(m is not None for m in metas) else None

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for connector in self.connectors:
            for key, value in connector.stats().items():
                out[key] = out.get(key, 0) + value
        return out

    def get_finished_loads(self, wait: bool = False) -> dict[str, int]:
        # NOTE: the first connector with finished loads loads this step; the others keep theirs for the next
        # call (a connector reports what finished since its last call).
        for i, connector in enumerate(self.connectors):
            finished = getattr(connector, "get_finished_loads", None)
            if finished is None or (self._loader is not None and i != self._loader):
                continue
            done = finished(wait=wait)
            if done:
                self._loader = i
                return dict(done)
        return {}

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self._chosen.pop(request.request_id, None)
        for connector in self.connectors:
            hook = getattr(connector, "request_finished", None)
            if hook is not None:
                hook(request, block_ids)

    # -- worker side -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: tuple[list[int], list[Any]]) -> None:
        order, metas = metadata
        for i in order:
            if metas[i] is not None:
                self.connectors[i].start_load_kv(metas[i])

    def shutdown(self) -> None:
        for connector in self.connectors:
            shutdown = getattr(connector, "shutdown", None)
            if shutdown is not None:
                shutdown()
