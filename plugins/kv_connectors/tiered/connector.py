"""TieredConnector: blocks the device pool evicts go to host memory, then (LRU) to disk; prefix hits come back.

NOTEs:

1. Offload on eviction, not on store (vLLM's offloading connector copies every newly full block out after
   the forward). The device prefix cache already holds a block until it is evicted, so copying it out
   earlier only doubles the bytes moved for blocks that never leave the device; at eviction its KV is still
   intact (the block's new owner writes it in this step's forward, after the plan runs), and the host
   tier then holds exactly what the device lost. The cost: the copy sits in front of that forward.
2. One ordered plan per step. The scheduler side records operations in the order the pool's evictions
   and the admissions happen (save, load, demote to disk, drop), and the worker runs them in that order
   before the forward. The order alone makes every case right: a block is evicted (saved) before it can be
   allocated as a load's target; a hash demoted and saved again in one step is written, dropped, then
   saved; a hit loaded from the host before a later eviction of the same step demotes it.
3. Hits being admitted are protected: the admission that asked for them allocates blocks next, and those
   evictions could push a just-found hit out of a tier's LRU before its load is planned. Protection ends
   with the admission (`update_state_after_alloc`) or the step.
4. Disk hits load asynchronously (vLLM's WAITING_FOR_REMOTE_KVS). A hit that includes a block on disk is
   answered `(tokens, True)`: the scheduler allocates the request's blocks and parks it, the plan queues the
   reads on the disk tier's thread (disk_io.py; after the step's demotions, so every file is there) and its
   host blocks' copies, and the forward of that step waits for none of the reads. `get_finished_loads`
   collects the reads; once all of a request's are in, the verified tensors are copied into its blocks by
   the plan of the step that resumes it, before that step's forward. A file that fails its checksum ends
   the hit there: the tokens before it count as computed, the rest are recomputed (vLLM's load errors).
   A host-only hit stays synchronous: its copies sit in front of the forward that reads them anyway.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.api.kv import KVConnectorContext
from pagedllm.api.sched import Request
from pagedllm.plugins.kv_connectors.tiered.block_io import BlockIO
from pagedllm.plugins.kv_connectors.tiered.disk_io import DiskIO
from pagedllm.plugins.kv_connectors.tiered.disk_tier import DiskTier
from pagedllm.plugins.kv_connectors.tiered.host_tier import HostTier

logger = logging.getLogger("pagedllm")

_GIB = 1 << 30
_LOAD_WAIT_S = 0.05  # get_finished_loads(wait=True): how long the idle engine waits for a read before looking again


@dataclass
class _Load:
    """One parked request's hit (NOTE 4): its hashes and target blocks in order, the reads still out."""

    hashes: list[bytes]
    block_ids: list[int]
    on_disk: set[bytes]
    results: dict[bytes, torch.Tensor | None] = field(default_factory=dict)


class TieredConnector:
    def __init__(self, ctx: KVConnectorContext) -> None:
        self.ctx = ctx
        self.block_size = ctx.block_size
        self.options = ctx.plugin_config
        self.io: BlockIO | None = None
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.disk_io: DiskIO | None = None
        self._plan: list[tuple[Any, ...]] = []
        self._protected: set[bytes] = set()  # NOTE 3
        self._query: tuple[str, int, bool] | None = None  # (request id, first block, load_async) of the last query
        self._loads: dict[str, _Load] = {}  # NOTE 4: parked requests, by id
        self._finished: dict[str, int] = {}  # parked requests whose reads are all in: tokens loaded
        self.counters = dict.fromkeys(
            ("host_hit_tokens", "disk_hit_tokens", "host_saved_bytes", "host_loaded_bytes", "disk_loaded_bytes",
             "disk_corrupt_files", "disk_missing_files"), 0)

    # -- worker side: set-up ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        io = self.io = BlockIO(kv_caches, self.ctx.block_axis)
        # Spare slots: blocks on their way to disk keep theirs until written (host_tier.py NOTE 1).
        spare = self.options.disk_write_queue_blocks if self.options.disk_dir is not None else 0
        self.host = HostTier(int(self.options.host_gb * _GIB) // io.block_bytes, io.block_shape, io.dtype,
                             io.pinned, spare)
        if self.options.disk_dir is not None:
            layout = f"{self.ctx.model}|{io.dtype}|{io.block_shape}|{self.block_size}".encode()
            self.disk = DiskTier(self.options.disk_dir, hashlib.sha256(layout).digest()[:16],
                                 int(self.options.disk_gb * _GIB), io.block_shape, io.dtype, io.block_bytes)
            self.disk_io = DiskIO(self.disk, self.options.disk_write_queue_blocks)

    # -- scheduler side -------------------------------------------------------------------------------------

    def on_device_evict(self, block_hash: bytes, block_id: int) -> None:
        host, disk, plan = self.host, self.disk, self._plan
        assert host is not None
        if block_hash in host:
            host.touch(block_hash)  # held already: the same tokens, so the same KV
            return
        host.add(block_hash)
        plan.append(("save", block_hash, block_id))
        while (old := host.pop_lru(self._protected)) is not None:
            if disk is None:
                plan.append(("drop_host", old))
            elif old in disk:
                disk.index.move_to_end(old)  # its file is already there
                plan.append(("drop_host", old))
            else:
                plan.append(("demote", old))
                plan.extend(("drop_disk", gone) for gone in disk.add(old, self._protected))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        host, disk, bs = self.host, self.disk, self.block_size
        assert host is not None
        self._forget_lost()
        start = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs  # the last token is always computed
        self._protected = set()
        found, from_disk = 0, False
        for block_hash in request.block_hashes[start:last]:
            if block_hash in host:
                self._protected.add(block_hash)
            elif disk is not None and block_hash in disk:
                self._protected.add(block_hash)
                from_disk = True  # NOTE 4: read in the background, verified before it counts
            else:
                break
            found += 1
        self._query = (request.request_id, start, from_disk)
        return found * bs, from_disk

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        host, disk, plan, rid = self.host, self.disk, self._plan, request.request_id
        assert host is not None and self._query is not None and self._query[0] == rid, \
            "update_state_after_alloc must follow get_num_new_matched_tokens for the same request"
        _, start, parked = self._query
        hashes = request.block_hashes[start : start + num_external_tokens // self.block_size]
        on_disk: set[bytes] = set()
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            if block_hash in host:
                host.touch(block_hash)
                plan.append(("load_host", block_hash, block_id))
            else:
                assert disk is not None and block_hash in disk, "a hit left both tiers before its admission"
                disk.touch(block_hash)
                plan.append(("read_disk", rid, block_hash))
                on_disk.add(block_hash)
        if parked:  # answered (tokens, True): the scheduler waits for get_finished_loads to name it
            load = _Load(list(hashes), list(block_ids), on_disk)
            if on_disk:
                self._loads[rid] = load
            else:  # (the scheduler kept only the hit's host blocks)
                self._finished[rid] = self._plan_finished_load(load)
        else:
            self.counters["host_hit_tokens"] += len(hashes) * self.block_size
        self._protected, self._query = set(), None

    def get_finished_loads(self, wait: bool = False) -> dict[str, int]:
        """Parked requests whose reads are all in, with the tokens loaded intact (NOTE 4); `wait`: the engine
        has nothing else to run, so block briefly for a read rather than spin."""
        disk_io = self.disk_io
        results = disk_io.results(_LOAD_WAIT_S if wait and not self._finished else 0.0) if disk_io is not None else []
        for rid, block_hash, data in results:
            if isinstance(data, str):
                assert self.disk is not None
                self.disk.unindex(block_hash)
                self.counters["disk_missing_files" if data.startswith("missing") else "disk_corrupt_files"] += 1
            load = self._loads.get(rid)
            if load is None:
                continue  # the request ended while its read was out
            load.results[block_hash] = data if isinstance(data, torch.Tensor) else None
            if len(load.results) == len(load.on_disk):
                del self._loads[rid]
                self._finished[rid] = self._plan_finished_load(load)
        finished, self._finished = self._finished, {}
        return finished

    def _plan_finished_load(self, load: _Load) -> int:
        """Copy the leading run of good blocks into the request's blocks (this step's plan); its tokens."""
        n = 0
        for block_hash, block_id in zip(load.hashes, load.block_ids, strict=True):
            if block_hash in load.on_disk:
                data = load.results[block_hash]
                if data is None:
                    break  # a miss: this block and all after it are recomputed
                self._plan.append(("load_data", data, block_id))
                self.counters["disk_hit_tokens"] += self.block_size
            else:
                self.counters["host_hit_tokens"] += self.block_size  # copied when the request was parked
            n += 1
        return n * self.block_size

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """A request ended; if it was still parked (aborted), its reads' results are dropped when they come."""
        self._loads.pop(request.request_id, None)
        self._finished.pop(request.request_id, None)

    def flush(self) -> None:
        """Wait until the disk tier's queued writes, deletes and reads have run (tests; a clean shutdown)."""
        if self.disk_io is not None:
            self.disk_io.flush()

    def shutdown(self) -> None:
        """The engine is shutting down: queued file writes land (a later engine finds them), the thread stops."""
        if self.disk_io is not None:
            self.disk_io.close()

    def _forget_lost(self) -> None:
        if self.disk_io is not None and self.disk is not None:
            for block_hash in self.disk_io.take_lost():
                self.disk.unindex(block_hash)

    def build_connector_meta(self) -> list[tuple[Any, ...]] | None:
        plan, self._plan = self._plan, []
        self._protected, self._query = set(), None
        return plan or None  # None: the runner has nothing to do this step

    def stats(self) -> dict[str, int]:
        self._forget_lost()  # disk_blocks: files on disk or queued, not writes dropped since the last step
        out = dict(self.counters)
        out["host_blocks"] = len(self.host.index) if self.host is not None else 0
        out["disk_blocks"] = len(self.disk.index) if self.disk is not None else 0
        disk_io = self.disk_io
        out["disk_written_bytes"] = disk_io.written_bytes if disk_io is not None else 0
        out["disk_writes_dropped"] = disk_io.writes_dropped if disk_io is not None else 0
        out["disk_write_queue_blocks"] = disk_io.pending_writes if disk_io is not None else 0
        out["loading_requests"] = len(self._loads)
        return out

    # -- worker side: the plan -------------------------------------------------------------------------------

    def start_load_kv(self, metadata: list[tuple[Any, ...]]) -> None:
        io, host, disk_io, counters = self.io, self.host, self.disk_io, self.counters
        assert io is not None and host is not None
        store = host.store
        # NOTE 2: in the order the scheduler recorded them. A run of saves, or of loads, is order-free within
        # itself (distinct blocks), so each run is copied as one batch (block_io.py).
        saves: list[tuple[bytes, int]] = []
        loads: list[tuple[int, torch.Tensor]] = []

        def flush() -> None:
            if saves:
                io.save([b for _, b in saves], [host.new_block(h) for h, _ in saves])
                counters["host_saved_bytes"] += io.block_bytes * len(saves)
                saves.clear()
            if loads:
                io.load([b for b, _ in loads], [d for _, d in loads])
                loads.clear()

        for op in metadata:
            kind = op[0]
            if kind == "save":
                if loads:
                    flush()
                saves.append((op[1], op[2]))
                continue
            if kind in ("load_host", "load_data"):
                if saves:
                    flush()
                loads.append((op[2], store[op[1]] if kind == "load_host" else op[1]))
                counters["host_loaded_bytes" if kind == "load_host" else "disk_loaded_bytes"] += io.block_bytes
                continue
            flush()
            if kind == "demote":
                assert disk_io is not None
                # Written behind (disk_io.py NOTE 2, 3): the I/O thread waits for the copy, not this step.
                data, slot = host.hand_over(op[1])
                disk_io.write(op[1], data, io.copies_done_event(),
                              None if slot is None else functools.partial(host.release, slot))
            elif kind == "read_disk":
                assert disk_io is not None
                disk_io.read(op[1], op[2])
            elif kind == "drop_host":
                host.drop(op[1])
            elif kind == "drop_disk":
                assert disk_io is not None
                disk_io.delete(op[1])
            else:
                raise AssertionError(f"unknown plan operation {kind!r}")
        flush()
        io.fence()
