"""RankWatchdog: the engine core's last resort when a tensor-parallel rank dies while rank 0 is inside a step.

Most deaths end the step by themselves: gloo fails a collective whose peer is gone at once, the executor checks
its ranks before every step and, at rest, every second (core_proc.py NOTE 4); the loop then reports Fatal and
the process exits. NCCL does not: a collective whose peer died waits for the group timeout
(parallel_state.DEFAULT_TIMEOUT_S, 5 minutes), and every request in flight would wait with it. So the
executor's monitor thread (`register_failure_callback`: sentinels of the rank processes, refs of the Ray
actors) calls `rank_died` at once, and if the loop has not reported the death itself within `grace_s` the
watchdog does: Fatal on a socket of its own (zmq sockets are not shared between threads), then the process
exits, which is all a rank stuck in a collective with a dead peer can still do.

    monitor thread ── rank_died(reason) ──▶ timer(grace_s) ──▶ Fatal(reason) on its own PUSH socket, exit(1)
    loop thread    ── the step fails / check_health raises ──▶ Fatal ──▶ disarm()   (the timer does nothing)
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from pagedllm.engine.serialization import Fatal, encode

logger = logging.getLogger("pagedllm")

# gloo fails the step within milliseconds and the Ray executor waits up to 5 s for the dead actor's own
# error (ray/executor.py _failure): past that, the step is stuck, not failing.
GRACE_S = 8.0


class RankWatchdog:
    def __init__(self, output_addr: str, grace_s: float = GRACE_S,
                 exit_process: Callable[[int], object] = os._exit) -> None:
        self.output_addr, self.grace_s, self._exit = output_addr, grace_s, exit_process
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._disarmed = False

    def rank_died(self, reason: str) -> None:
        """The executor's monitor saw a rank die (any thread): start the grace period, once."""
        with self._lock:
            if self._disarmed or self._timer is not None:
                return
            logger.error("engine core: %s", reason)
            self._timer = threading.Timer(self.grace_s, self._fire, args=(reason,))
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        """The loop has reported (or the engine is shutting down): nothing left for the watchdog to do."""
        with self._lock:
            self._disarmed = True
            if self._timer is not None:
                self._timer.cancel()

    def _fire(self, reason: str) -> None:
        import zmq

        with self._lock:
            if self._disarmed:
                return
            self._disarmed = True
        logger.error("engine core: the step did not end within %.0fs of the rank's death; exiting", self.grace_s)
        ctx = zmq.Context()
        try:
            out = ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 2000)  # let Fatal reach the API process before the exit
            out.connect(self.output_addr)
            out.send(encode(Fatal(f"{reason} (the engine core was stuck in a step; exited)")))
            out.close()
        finally:
            ctx.term()
        self._exit(1)
