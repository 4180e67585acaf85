"""The thread that runs a pipelined step's grammar work beside the engine's host work (manager.py NOTE 4).

One worker thread, so at most one step's grammar work is in flight and the grammars it touches are touched by
nobody else until the runner joins it. While a task runs, the interpreter's switch interval is lowered (NOTE 1).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# NOTE(1) the GIL. The engine's host work between two steps (applying outputs, scheduling, laying out inputs)
# is Python that holds the GIL; a thread that wants it waits out the switch interval (5 ms by default) before
# the holder is made to let go. Measured on the shared 2-core machine (2026-12-01, 256 xgrammar matchers of
# examples/gpu/bench_structured.py's schema beside an 8 ms busy Python loop): at 5 ms the thread's batch fill
# started after the loop had ended (11.2 ms); at 0.5 ms it started at 0.7 ms and was done at 1.7 ms, in
# parallel with the loop (xgrammar's batch calls release the GIL). The worker takes the GIL only around those
# batch calls, a handful of times a step, so a short interval costs the engine thread little.
SWITCH_INTERVAL_S = 0.00025


@dataclass
class AheadResult:
    """What the worker did for one step: the tokens it accepted and the next step's rows it filled."""

    req_ids: list[str]  # the step's request ids, the very list its ModelRunnerOutput carries (matched by identity)
    status: dict[str, tuple[bool, bool]]  # request id -> (its token accepted, its grammar terminated after it)
    rows: dict[str, int]  # request id -> its row of the mask buffer, filled for the request's next sample


class AheadWorker:
    """Runs one task at a time on its own thread, the switch interval lowered while it runs."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._saved_interval: float | None = None

    def start(self, task: Callable[[], T]) -> Callable[[], T]:
        """Run `task` on the worker, the switch interval lowered until it ends (the worker restores it: a
        step left in flight when generate() returns keeps no lowered interval); the returned join waits for
        it, re-raising its error. Call the join before starting the next task."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar-ahead")
        current = sys.getswitchinterval()
        if current > SWITCH_INTERVAL_S:
            self._saved_interval = current
            sys.setswitchinterval(SWITCH_INTERVAL_S)

        def run() -> T:
            try:
                return task()
            finally:
                self._restore()

        return self._pool.submit(run).result

    def _restore(self) -> None:
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._restore()
