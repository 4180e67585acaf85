"""PDConnector: a prefill engine keeps each request's full prompt blocks for a decode engine, which fetches them.

Per request, `SamplingParams.extra_args["kv_transfer_params"]` (vLLM's names; the router writes them):

- on the prefill engine: {"do_remote_decode": true, "transfer_id": T}. When the request ends (max_tokens=1:
  after its prefill), `request_finished` copies its full prompt blocks to host memory, held under T.
- on the decode engine: {"do_remote_prefill": true, "transfer_id": T, "remote_host": H, "remote_port": P}.
  At admission `get_num_new_matched_tokens` claims the prompt's full blocks past the device prefix hit as
  loaded in the background (`(tokens, True)`, vLLM's load_kv_async): the scheduler gives the request its
  blocks and parks it, and a fetch thread gets T from H:P and checks it (layout, model, the token ids the
  blocks hold, the checksum). `get_finished_loads` then hands the request back with the tokens that arrived;
  they are written into its blocks before its next forward and count in `num_cached_tokens`. The rest of
  the prompt (the partial last block, at least the last token) is computed here, and decoding goes on.

NOTEs:

1. Any failure is a local prefill, never wrong KV: a refused connection, a dead or stalled producer (the
   fetch has one deadline, `transfer_timeout_s`), a truncated frame, a checksum, layout or token mismatch,
   an expired transfer. The parked request then resumes with 0 tokens loaded and computes its whole prompt
   in the blocks it already holds: the same tokens, later. `transfer_failures` counts them, the log says why.
2. The fetch runs on its own thread while the engine steps the other requests (the request waits in
   RequestStatus.WAITING_FOR_REMOTE_KVS, as in vLLM); nothing blocks `schedule()` but the copy into the
   blocks, which runs in the step's plan. A policy that cannot park requests (it calls
   `external_prefix_hit`) treats the claim as a miss: the request prefills locally.
3. Copy at finish, not delayed free. vLLM's producer keeps the request's device blocks until the consumer
   has read them; here `request_finished` copies them to host memory at once and the device blocks go back
   to the pool, so a slow or absent decode engine never holds the prefill engine's KV cache. The host copy
   waits `hold_s` at most, within `max_held_gb`. The copy is right even with async scheduling: it runs in
   the update after the step that computed the prompt, and the step already in flight does not hold the
   request (its last token was in flight), so nothing has written its blocks. On CUDA it is a synchronous
   device-to-host copy on the engine-core thread.
4. A fetch starts when the request is parked (`update_state_after_alloc`): the claim itself is pure (a
   request the scheduler then cannot give blocks to asks again next step, and nothing was fetched). A
   request that ends while its fetch is out (aborted) is forgotten: its blocks are freed and reused, so the
   fetch's result is dropped, never copied into them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.api.kv import KVConnectorContext
from pagedllm.api.sched import Request, RequestStatus
from pagedllm.plugins.kv_connectors.pd.blocks import BlockCopier
from pagedllm.plugins.kv_connectors.pd.transport import HeldKV, KVTransport, TCPTransport
from pagedllm.plugins.kv_connectors.pd.wire import WireError

log = logging.getLogger(__name__)

_GIB = 1 << 30
_DONE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class _Fetch:
    """A parked request's transfer: where its blocks go, and (once the fetch thread is done) what arrived."""

    first: int  # the request's first block the transfer fills (past its device prefix hit)
    block_ids: list[int]  # the device blocks for the claimed tokens, in order
    data: torch.Tensor | None = None  # [blocks that arrived, *block shape]; None: nothing usable arrived
    done: bool = False


def transfer_params(request: Request) -> dict[str, Any] | None:
    extra = request.sampling_params.extra_args
    params = extra.get("kv_transfer_params") if extra else None
    return params if isinstance(params, dict) else None


class PDConnector:
    def __init__(self, ctx: KVConnectorContext, transport: KVTransport | None = None) -> None:
        self.ctx = ctx
        self.options = ctx.plugin_config
        self.block_size = ctx.block_size
        role = self.options.role
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        self.transport = transport or TCPTransport(self.options.host, self.options.port)
        self.copier: BlockCopier | None = None
        self.address: tuple[str, int] | None = None
        # producer: transfer id -> HeldKV, oldest first (NOTE 3); the KV server's threads take from it.
        self._held: OrderedDict[str, HeldKV] = OrderedDict()
        self._held_bytes = 0
        self._lock = threading.Lock()
        # consumer: request id -> its transfer, from parking to get_finished_loads (NOTE 4); the fetch threads
        # fill them in under the lock and notify `_arrived`.
        self._fetches: dict[str, _Fetch] = {}
        self._arrived = threading.Condition(self._lock)
        self._pool: ThreadPoolExecutor | None = None
        self._query: tuple[str, int] | None = None  # (request id, first block) of the last claim
        self._plan: list[tuple[torch.Tensor, list[int]]] = []
        self.counters = dict.fromkeys(
            ("transfers_held", "sent_bytes", "transfers_expired", "transfers_received", "received_bytes",
             "remote_hit_tokens", "transfer_failures"), 0)

    # -- worker side: set-up ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.copier = BlockCopier(kv_caches, self.ctx.block_axis)
        if self.producer:
            self.address = self.transport.serve(self._take)
            # A port the system picked must be seen: the router is told it (--prefill-kv).
            level = logging.WARNING if self.options.port == 0 else logging.INFO
            log.log(level, "pd connector (%s): KV server listening on %s:%d", self.options.role, *self.address)

    def _layout(self) -> dict[str, Any]:
        assert self.copier is not None
        return {"model": self.ctx.model, "block_size": self.block_size, **self.copier.layout()}

    # -- producer: hold a finished prefill's blocks ----------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        with self._lock:
            self._fetches.pop(request.request_id, None)  # NOTE 4: ended while parked; drop what arrives
        params = transfer_params(request)
        if not self.producer or params is None or not params.get("do_remote_decode"):
            return
        if request.status not in _DONE:
            return  # aborted or failed: its KV may be incomplete, and no decode request will ask for it
        # The full blocks before the last prompt token: the decode engine computes that token (its logits
        # sample the first output), so a block ending with it would never be used.
        num_blocks = min((len(request.prompt_token_ids) - 1) // self.block_size, len(block_ids))
        if num_blocks <= 0:
            return  # nothing a decode engine could take: it computes this short prompt itself
        assert self.copier is not None
        data = self.copier.gather(block_ids[:num_blocks])
        payload = data.view(torch.uint8).reshape(-1).numpy().data  # the tensor's own bytes, no copy
        header = {"status": "ok", **self._layout(), "num_blocks": num_blocks,
                  "token_ids": list(request.prompt_token_ids[: num_blocks * self.block_size]),
                  "payload_bytes": payload.nbytes}  # the KV server's thread adds the checksum, off this one
        transfer_id = str(params.get("transfer_id"))
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            old = self._held.pop(transfer_id, None)
            if old is not None:
                self._held_bytes -= old.payload.nbytes
            self._held[transfer_id] = HeldKV(header, payload, now + self.options.hold_s)
            self._held_bytes += payload.nbytes
            cap = int(self.options.max_held_gb * _GIB)
            while self._held_bytes > cap and len(self._held) > 1:
                _, gone = self._held.popitem(last=False)
                self._held_bytes -= gone.payload.nbytes
                self.counters["transfers_expired"] += 1
            self.counters["transfers_held"] += 1

    def _expire(self, now: float) -> None:
        while self._held:
            first = next(iter(self._held.values()))
            if first.expires > now:
                return
            self._held.popitem(last=False)
            self._held_bytes -= first.payload.nbytes
            self.counters["transfers_expired"] += 1

    def _take(self, transfer_id: str) -> HeldKV | None:
        """The KV server's lookup (its own thread): one fetch per transfer."""
        with self._lock:
            self._expire(time.monotonic())
            held = self._held.pop(transfer_id, None)
            if held is not None:
                self._held_bytes -= held.payload.nbytes
                self.counters["sent_bytes"] += held.payload.nbytes
            return held

    # -- consumer: claim at admission, fetch in the background ---------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | tuple[int, bool]:
        params = transfer_params(request)
        if not self.consumer or params is None or not params.get("do_remote_prefill"):
            return 0
        start = num_computed_tokens // self.block_size
        self._query = (request.request_id, start)
        # What the producer holds: the full blocks before the last prompt token (request_finished).
        claim = ((len(request.prompt_token_ids) - 1) // self.block_size - start) * self.block_size
        return (claim, True) if claim > 0 else 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        assert self._query is not None and self._query[0] == request.request_id, \
            "update_state_after_alloc must follow get_num_new_matched_tokens for the same request"
        rid, fetch = request.request_id, _Fetch(self._query[1], list(block_ids))
        self._query = None
        params = transfer_params(request)
        assert params is not None
        with self._lock:
            self._fetches[rid] = fetch
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pd-kv-fetch")
        tokens = list(request.prompt_token_ids[: (fetch.first + len(block_ids)) * self.block_size])
        self._pool.submit(self._fetch, rid, fetch, params, tokens)

    def _fetch(self, rid: str, fetch: _Fetch, params: dict[str, Any], tokens: list[int]) -> None:
        """On a fetch thread: get the transfer, check it, keep the claimed blocks (NOTE 1: or nothing)."""
        data = None
        try:
            data = self._receive(params, tokens, fetch.first + len(fetch.block_ids))
        except Exception as exc:  # NOTE 1: whatever went wrong, the request computes its prompt
            with self._lock:
                self.counters["transfer_failures"] += 1
            log.warning("pd connector: request %s prefills locally: %s", rid, exc)
        with self._arrived:
            if data is not None:
                self.counters["transfers_received"] += 1
                self.counters["received_bytes"] += data.numel() * data.element_size()
                data = data[fetch.first : fetch.first + len(fetch.block_ids)]
            fetch.data, fetch.done = data, True
            self._arrived.notify_all()

    def _receive(self, params: dict[str, Any], tokens: list[int], num_needed: int) -> torch.Tensor:
        assert self.copier is not None
        header, payload = self.transport.fetch(str(params.get("remote_host")), int(params.get("remote_port", 0)),
                                               str(params.get("transfer_id")), self.options.transfer_timeout_s)
        mine = self._layout()
        theirs = {key: header.get(key) for key in mine}
        if theirs != mine:
            raise WireError(f"the producer's layout {theirs} is not this engine's {mine}")
        num_blocks = header.get("num_blocks")
        if not isinstance(num_blocks, int) or num_blocks * self.copier.block_bytes != len(payload):
            raise WireError(f"{len(payload)} payload bytes for {num_blocks!r} blocks")
        if num_blocks < num_needed:
            raise WireError(f"the producer holds {num_blocks} blocks of the prompt, {num_needed} were claimed")
        if header.get("token_ids", [])[: len(tokens)] != tokens:
            raise WireError("the transferred blocks hold other tokens than this request's prompt")
        return self.copier.from_bytes(payload, num_blocks)

    def get_finished_loads(self, wait: bool = False) -> dict[str, int]:
        """Parked requests whose fetch is done: the tokens that arrived (0: it failed), copies planned."""
        with self._arrived:
            if wait and self._fetches and not any(f.done for f in self._fetches.values()):
                # Nothing else to run: wait a little for a transfer rather than have the engine spin.
                self._arrived.wait(0.02)
            done = {rid: f for rid, f in self._fetches.items() if f.done}
            for rid in done:
                del self._fetches[rid]
        finished = {}
        for rid, fetch in done.items():
            if fetch.data is None:
                finished[rid] = 0
                continue
            self._plan.append((fetch.data, fetch.block_ids))
            finished[rid] = len(fetch.block_ids) * self.block_size
            self.counters["remote_hit_tokens"] += finished[rid]
        return finished

    def on_device_evict(self, block_hash: bytes, block_id: int) -> None:
        return None  # the device prefix cache's evictions are not this connector's business

    def build_connector_meta(self) -> list[tuple[torch.Tensor, list[int]]] | None:
        plan, self._plan = self._plan, []
        self._query = None
        return plan or None

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        with self._lock:
            out["held_blocks"] = sum(h.header["num_blocks"] for h in self._held.values())
        return out

    # -- worker side: the plan -------------------------------------------------------------------------------

    def start_load_kv(self, metadata: list[tuple[torch.Tensor, list[int]]]) -> None:
        assert self.copier is not None
        for data, block_ids in metadata:
            self.copier.scatter(data, block_ids)
