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
    pipeline parallelism (N = tp x pp):        the last stage's tp rank 0 puts ("output", r, output)
          launch_model / collect_model ◀────   on the outbox; steps in flight come back in launch order
          (tp_worker.py NOTE 4)
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
NOTE 4: and a monitor thread (as vLLM's `start_worker_monitor`) waits on the workers' sentinels from `bind` on,
calling the failure callback the moment one exits: the engine core's watchdog ends a step that a dead peer
would otherwise hold inside an NCCL collective until the group timeout (engine/rank_watchdog.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
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
        self.pp_size = ctx.pp_size
        self.world_size = ctx.world_size  # ranks 1..world_size-1 are workers (tp x pp, global rank order)
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._runner: Any = None
        self._previous: ModelRunnerOutput | None = None
        self._closed = False
        self._failure_callback: Callable[[str], None] | None = None

    def start(self) -> None:
        from pagedllm.api.engine import resolve_device

        addr, port = "127.0.0.1", free_port()
        mp = multiprocessing.get_context("spawn")
        self._outbox = mp.Queue()
        config_dict = self.config.model_dump()
        with _children_allowed():
            for rank in range(1, self.world_size):
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
        init_tensor_parallel(0, self.world_size, master_addr=addr, master_port=port,
                             device=resolve_device(self.config.device), pipeline_parallel_size=self.pp_size)

    def bind(self, runner: Any) -> None:
        self._runner = runner
        waiting = set(range(1, self.world_size))
        while waiting:
            try:
                kind, rank, detail = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                self.check_health()
                continue
            if kind == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to build its shard:\n{detail}")
            waiting.discard(rank)
        if self._procs:
            threading.Thread(target=self._monitor, name="pagedllm-tp-monitor", daemon=True).start()

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._failure_callback = callback

    def _monitor(self) -> None:
        """NOTE 4: block until a worker exits; unless we are shutting down, tell the failure callback."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self._procs])
        callback = self._failure_callback
        if self._closed or callback is None:
            return
        # Not `is_alive()`/`exitcode` here: waitpid from two threads races (the loop's check_health reaps it).
        ranks = ", ".join(f"{r} (pid {p.pid})" for r, p in enumerate(self._procs, start=1) if p.sentinel in ended)
        callback(f"tensor-parallel rank {ranks} died")

    def _send(self, message: bytes) -> None:
        self.check_health()
        for inbox in self._inboxes:
            inbox.put(message)

    def _output_rank_result(self) -> ModelRunnerOutput:
        """The last pipeline stage's output of this step, from its worker's outbox (tp_worker.py NOTE 4)."""
        while True:
            try:
                kind, rank, detail = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                self.check_health()
                continue
            if kind == "output":
                return detail  # type: ignore[no-any-return]
            if kind == "error":
                raise WorkerDiedError(f"pipeline-parallel rank {rank} failed:\n{detail}")

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
        # A killed peer's sockets close (failing our collective) together with its sentinel, a moment before
        # the kernel lets its exit be reaped (is_alive() is still True then): go by the sentinels, waiting
        # briefly, and join the dead (a blocking reap of a process already exiting) for their exit codes.
        ended = multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=2.0)
        dead = [r for r, p in enumerate(self._procs, start=1) if p.sentinel in ended]
        for r in dead:
            self._procs[r - 1].join(timeout=1.0)
        detail = self._worker_errors(wait_s=0.5 if dead else 0.0)
        if not dead and not detail:
            return exc
        ranks = ", ".join(f"{r} (pid {self._procs[r - 1].pid}, exit code {self._procs[r - 1].exitcode})"
                          for r in dead) or "?"
        return WorkerDiedError(
            f"tensor-parallel rank {ranks} died during a step ({type(exc).__name__}: {exc})"
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
            output = worker.execute(message)
            if output is not None:  # the last pipeline stage's output rank (tp_worker.py NOTE 4)
                outbox.put(("output", rank, output))
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        worker.close()
