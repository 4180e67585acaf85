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
   evictions could push a just-found host hit out of the LRU before its load is planned. Protection ends
   with the admission (`update_state_after_alloc`) or the step.
4. A disk hit is read and verified while the scheduler asks (get_num_new_matched_tokens), not when the plan
   runs: a file that fails its checksum must be a miss before its tokens count as computed. The verified
   tensor rides in the plan.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from pagedllm.api.kv import KVConnectorContext
from pagedllm.api.sched import Request
from pagedllm.plugins.kv_connectors.tiered.block_io import BlockIO
from pagedllm.plugins.kv_connectors.tiered.disk_tier import DiskTier
from pagedllm.plugins.kv_connectors.tiered.host_tier import HostTier

_GIB = 1 << 30


class TieredConnector:
    def __init__(self, ctx: KVConnectorContext) -> None:
        self.ctx = ctx
        self.block_size = ctx.block_size
        self.options = ctx.plugin_config
        self.io: BlockIO | None = None
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self._plan: list[tuple[Any, ...]] = []
        self._protected: set[bytes] = set()  # NOTE 3
        self._staged: dict[bytes, torch.Tensor] = {}  # NOTE 4: verified disk hits of the current query
        self._query: tuple[str, int] | None = None  # (request id, first block) of the last hit query
        self.counters = dict.fromkeys(
            ("host_hit_tokens", "disk_hit_tokens", "host_saved_bytes", "host_loaded_bytes", "disk_written_bytes",
             "disk_loaded_bytes", "disk_corrupt_files"), 0)

    # -- worker side: set-up ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        io = self.io = BlockIO(kv_caches, self.ctx.block_axis)
        self.host = HostTier(int(self.options.host_gb * _GIB) // io.block_bytes)
        if self.options.disk_dir is not None:
            layout = f"{self.ctx.model}|{io.dtype}|{io.block_shape}|{self.block_size}".encode()
            self.disk = DiskTier(self.options.disk_dir, hashlib.sha256(layout).digest()[:16],
                                 int(self.options.disk_gb * _GIB), io.block_shape, io.dtype, io.block_bytes)

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
                plan.extend(("drop_disk", gone) for gone in disk.add(old))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        host, disk, bs = self.host, self.disk, self.block_size
        assert host is not None
        start = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs  # the last token is always computed
        self._protected, self._staged = set(), {}
        self._query = (request.request_id, start)
        found = 0
        for block_hash in request.block_hashes[start:last]:
            if block_hash in host:
                self._protected.add(block_hash)
            elif disk is not None and block_hash in disk:
                data = disk.read(block_hash)
                if data is None:
                    self.counters["disk_corrupt_files"] = disk.corrupt_files
                    break  # NOTE 4: a miss, and a hit is a leading run of hashes
                self._staged[block_hash] = data
            else:
                break
            found += 1
        return found * bs

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        host = self.host
        assert host is not None and self._query is not None and self._query[0] == request.request_id, \
            "update_state_after_alloc must follow get_num_new_matched_tokens for the same request"
        start = self._query[1]
        hashes = request.block_hashes[start : start + num_external_tokens // self.block_size]
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            data = self._staged.get(block_hash)
            if data is not None:
                self._plan.append(("load_data", data, block_id))
                self.counters["disk_hit_tokens"] += self.block_size
            else:
                assert block_hash in host, "a protected host hit left the tier (NOTE 3)"
                host.touch(block_hash)
                self._plan.append(("load_host", block_hash, block_id))
                self.counters["host_hit_tokens"] += self.block_size
        self._protected, self._staged, self._query = set(), {}, None

    def build_connector_meta(self) -> list[tuple[Any, ...]] | None:
        plan, self._plan = self._plan, []
        self._protected, self._staged, self._query = set(), {}, None
        return plan or None  # None: the runner has nothing to do this step

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["host_blocks"] = len(self.host.index) if self.host is not None else 0
        out["disk_blocks"] = len(self.disk.index) if self.disk is not None else 0
        return out

    # -- worker side: the plan -------------------------------------------------------------------------------

    def start_load_kv(self, metadata: list[tuple[Any, ...]]) -> None:
        io, host, disk, counters = self.io, self.host, self.disk, self.counters
        assert io is not None and host is not None
        store = host.store
        for op in metadata:  # NOTE 2: in the order the scheduler recorded them
            kind = op[0]
            if kind == "save":
                store[op[1]] = io.save(op[2])
                counters["host_saved_bytes"] += io.block_bytes
            elif kind == "load_host":
                io.load(op[2], store[op[1]])
                counters["host_loaded_bytes"] += io.block_bytes
            elif kind == "load_data":
                io.load(op[2], op[1])
                counters["disk_loaded_bytes"] += io.block_bytes
            elif kind == "demote":
                assert disk is not None
                io.host_ready()  # the tensor may still be filling on the side stream
                counters["disk_written_bytes"] += disk.write(op[1], store.pop(op[1]))
            elif kind == "drop_host":
                store.pop(op[1], None)
            elif kind == "drop_disk":
                assert disk is not None
                disk.delete(op[1])
            else:
                raise AssertionError(f"unknown plan operation {kind!r}")
        io.fence()
