"""DiskIO: the disk tier's background thread, so that no step waits for a file it does not need.

NOTEs:

1. One thread, one FIFO queue of jobs (write, read, delete), run one at a time in the order they were queued.
   The order is the whole consistency story: the scheduler side indexes a hash when it plans the block's
   write, and any read it plans later is queued after that write, so it finds the file; a delete queued
   after a write removes what the write made.
2. Write-behind with a bound. A demoted block's host tensor waits in the queue until its file is written, at
   most `max_pending_writes` blocks of them; past that bound a write is dropped (the block leaves the tiers,
   and a later request recomputes it) rather than making the step wait for the disk or letting host memory
   grow without limit. Dropped writes are counted and handed back (`take_lost`) for the index to forget.
3. On CUDA a demoted tensor may still be filling from the device (its save ran on the copy stream): the job
   carries that copy's event and the I/O thread waits for it, not the step.
4. A read of a block still waiting in the write-behind queue is answered from the queued tensor: no file
   round trip, and no race with the write. The tensor may be a slot of the host tier that the tier reuses
   once it is handed back (host_tier.py NOTE 1), so a read takes a copy, and the slot goes back (`on_done`)
   only when the write and every such read are through with it.
5. Reads report back through `results()`, polled by the scheduler side at each step (vLLM's
   `get_finished`); each carries the caller's tag (the request id) and the tensor, or why it is a miss.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.plugins.kv_connectors.tiered.disk_tier import DiskTier

logger = logging.getLogger("pagedllm")

ReadResult = tuple[str, bytes, "torch.Tensor | str"]  # (tag, block hash, KV or why it is a miss)


class DiskIO:
    def __init__(self, tier: DiskTier, max_pending_writes: int) -> None:
        self.tier = tier
        self.max_pending_writes = max_pending_writes
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._done: queue.Queue[ReadResult] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Held] = {}  # NOTE 4: written behind, not on disk yet
        self._lost: list[bytes] = []  # NOTE 2: dropped or failed writes, for the index to forget
        self.written_bytes = 0
        self.writes_dropped = 0
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-disk-io", daemon=True)
        self._thread.start()
        # Queued writes land before the interpreter exits (a later engine finds them); weakly, so an engine
        # dropped by its owner is not kept alive by the hook.
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- the engine's side ----------------------------------------------------------------------------------

    def write(self, block_hash: bytes, data: torch.Tensor, ready: Any = None,
              on_done: Callable[[], None] | None = None) -> bool:
        """Queue the block's file write (`ready`: a CUDA event the copy into `data` records); False: dropped.
        `on_done` runs (on the I/O thread, or here when dropped) once nothing reads `data` any more."""
        held = _Held(data, on_done, self._lock)
        with self._lock:
            if len(self._pending) >= self.max_pending_writes:
                self.writes_dropped += 1
                self._lost.append(block_hash)
                dropped = True
            else:
                self._pending[block_hash] = held
                dropped = False
        if dropped:
            held.unref()
            return False
        self._jobs.put(lambda: self._write(block_hash, held, ready))
        return True

    def read(self, tag: str, block_hash: bytes) -> None:
        """Queue a verified read; its result comes back through `results()` with `tag`."""
        with self._lock:
            queued = self._pending.get(block_hash)
            if queued is not None:
                queued.refs += 1
        if queued is not None:  # NOTE 4: after the write's job, so the copy into it has landed
            def answer(held: _Held = queued) -> None:
                self._done.put((tag, block_hash, held.data.clone()))
                held.unref()

            self._jobs.put(answer)
        else:
            self._jobs.put(lambda: self._done.put((tag, block_hash, self.tier.load(block_hash))))

    def delete(self, block_hash: bytes) -> None:
        self._jobs.put(lambda: self.tier.delete(block_hash))

    def results(self, timeout: float = 0.0) -> list[ReadResult]:
        """Reads finished since the last call; with `timeout`, wait that long for the first if none is ready."""
        out: list[ReadResult] = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            return out

    def take_lost(self) -> list[bytes]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        """Wait until every job queued so far has run (their files are written, deleted or read)."""
        self._jobs.join()

    def close(self) -> None:
        """Flush, then stop the thread (idempotent)."""
        if self._thread.is_alive():
            self.flush()
            self._jobs.put(None)
            self._thread.join()

    # -- the I/O thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            finally:
                self._jobs.task_done()

    def _write(self, block_hash: bytes, held: _Held, ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # NOTE 3
        try:
            n = self.tier.write(block_hash, held.data)
        except OSError as exc:  # a full or read-only disk: the block is lost to the tiers, not the engine
            logger.warning("kv disk tier: writing %s failed (%s): the block is dropped", self.tier.path(block_hash),
                           exc)
            n = 0
        with self._lock:
            if n:
                self.written_bytes += n
            else:
                self._lost.append(block_hash)
            if self._pending.get(block_hash) is held:  # (a later write of the same hash keeps its entry)
                del self._pending[block_hash]
        held.unref()


class _Held:
    """A tensor waiting to be written, with who still reads it (the write, queued reads: NOTE 4)."""

    def __init__(self, data: torch.Tensor, on_done: Callable[[], None] | None, lock: threading.Lock) -> None:
        self.data, self.on_done, self.refs, self._lock = data, on_done, 1, lock

    def unref(self) -> None:
        with self._lock:
            self.refs -= 1
            done = self.refs == 0
        if done and self.on_done is not None:
            self.on_done()


def _close_if_alive(ref: weakref.ref[DiskIO]) -> None:
    io = ref()
    if io is not None:
        io.close()
