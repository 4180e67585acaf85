"""MultiprocExecutor: tensor-parallel ranks 1..N-1 as spawned local processes; rank 0 is the engine core.

    engine core (rank 0)                       worker process (rank r)
    ─────────────────────                      ───────────────────────
    start: spawn ranks, join group  ◀──────▶   join group (tcp://127.0.0.1:<free port>)
    build rank 0's shard                       build rank r's shard (same config)
    bind: wait for "ready" per rank  ◀──────   outbox: ("ready", r) or ("error", r, traceback)
    step: pickle (SchedulerOutput, previous
          output) once, put in every inbox ──▶ inbox.get(); adopt rank 0's tokens; runner.execute()
          run rank 0's runner          ◀─────▶ (they meet in the model's all-reduces / all-gathers)
          return rank 0's output
    pipelined step (async scheduling): the
          same, without `previous`      ──▶    runner.execute_pipelined() (rank 0's ids come by broadcast)
    shutdown: None to every inbox; drop
          rank 0's CUDA graphs, leave   ──▶   drop CUDA graphs, leave group, exit

NOTE 1: the control plane is a multiprocessing queue per rank, not a torch.distributed broadcast: a worker
waits for the next step for as long as the engine is idle, which a collective would turn into a timeout.
NOTE 2: the server's engine core is a daemonic process, and multiprocessing refuses to start children from
one. Workers are themselves daemonic and also exit on their own when their parent disappears (they poll
`getppid`), so the flag is lifted only while they are started.
NOTE 3: a worker that dies between steps is found before the next step is sent (`is_alive`); one that dies
inside a collective makes rank 0's collective fail (gloo: connection closed; else the group timeout), and
the error raised names the rank and carries its traceback when it managed to send one.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import traceback
from collections.abc import Iterator
from typing import Any

from pagedllm.api.executor import (
    ExecutorContext,
    Rank0Driver,
    TPWorker,
    WorkerDiedError,
    destroy_tensor_parallel,
    free_port,
    init_tensor_parallel,
)
from pagedllm.api.sched import ModelRunnerOutput

logger = logging.getLogger("pagedllm")

_POLL_S = 1.0  # how often an idle worker checks that its parent is alive
_READY_TIMEOUT_S = 600.0  # building a large shard (load + CUDA graph capture) can take minutes


class MultiprocExecutor(Rank0Driver):
    def __init__(self, ctx: ExecutorContext) -> None:
        self.config = ctx.config
        self.tp_size = ctx.tp_size
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._runner: Any = None
        self._previous: ModelRunnerOutput | None = None
        self._closed = False

    def start(self) -> None:
        from pagedllm.api.engine import resolve_device

        addr, port = "127.0.0.1", free_port()
        mp = multiprocessing.get_context("spawn")
        self._outbox = mp.Queue()
        config_dict = self.config.model_dump()
        with _children_allowed():
            for rank in range(1, self.tp_size):
                inbox = mp.Queue()
                proc = mp.Process(
                    target=run_tp_worker,
                    args=(config_dict, rank, addr, port, inbox, self._outbox, os.getpid()),
                    name=f"pagedllm-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
                self._inboxes.append(inbox)
        init_tensor_parallel(0, self.tp_size, master_addr=addr, master_port=port,
                             device=resolve_device(self.config.device))

    def bind(self, runner: Any) -> None:
        self._runner = runner
        waiting = set(range(1, self.tp_size))
        while waiting:
            try:
                kind, rank, detail = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                self.check_health()
                continue
            if kind == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to build its shard:\n{detail}")
            waiting.discard(rank)

    def _send(self, message: bytes) -> None:
        self.check_health()
        for inbox in self._inboxes:
            inbox.put(message)

    def check_health(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                detail = self._worker_errors()
                raise WorkerDiedError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                    + (f":\n{detail}" if detail else "")
                )

    def _worker_errors(self, wait_s: float = 0.0) -> str:
        """Tracebacks the workers sent (waiting up to `wait_s` for the first)."""
        found = []
        with contextlib.suppress(queue.Empty, OSError, ValueError):
            while True:
                kind, rank, detail = self._outbox.get(timeout=wait_s) if wait_s else self._outbox.get_nowait()
                wait_s = 0.0
                if kind == "error":
                    found.append(f"rank {rank}: {detail}")
        return "\n".join(found)

    def _failure(self, exc: Exception) -> Exception:
        """Rank 0's step failed: most often because a peer died in the collective (NOTE 3)."""
        dead = [r for r, p in enumerate(self._procs, start=1) if not p.is_alive()]
        detail = self._worker_errors(wait_s=1.0)
        if not dead and not detail:
            return exc
        ranks = ", ".join(map(str, dead)) or "?"
        return WorkerDiedError(
            f"tensor-parallel step failed ({type(exc).__name__}: {exc}); dead rank(s): {ranks}"
            + (f"\n{detail}" if detail else "")
        )

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        # Rank 0 leaves the group while the workers leave theirs (NCCL's teardown waits for every rank, and for
        # every CUDA graph holding its collectives: cuda_graphs.py NOTE 5).
        if self._runner is not None:
            self._runner.release_cuda_graphs()
        destroy_tensor_parallel(timeout_s=10.0 if all(p.is_alive() for p in self._procs) else 1.0)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for q in [*self._inboxes, self._outbox]:
            if q is not None:
                q.cancel_join_thread()  # never block exit on a message a dead worker will not read
                q.close()
        self._runner = None


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """NOTE 2: let a daemonic process start the worker processes."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if was is not None:
            config["daemon"] = was
        else:
            config.pop("daemon", None)


def run_tp_worker(
    config_dict: dict[str, Any],
    rank: int,
    master_addr: str,
    master_port: int,
    inbox: Any,
    outbox: Any,
    parent_pid: int,
) -> None:
    """Worker process entry point: build the shard, report ready, run steps until None (or the parent dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the parent decides
    worker = TPWorker(config_dict, rank, master_addr, master_port)
    try:
        worker.build()
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))
        worker.close()
        return
    outbox.put(("ready", rank, ""))
    try:
        while True:
            try:
                message = inbox.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    logger.warning("tensor-parallel rank %d: the engine core is gone; exiting", rank)
                    return
                continue
            if message is None:
                return
            worker.execute(message)
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        worker.close()
