"""Warn at start-up when the machine's load makes the engine's CPU thread count slow.

torch's CPU kernels split each op over `num_threads` threads and wait for the slowest; when other processes
already keep the cores busy, a thread that is not scheduled stalls the whole op. On a 2-core machine with a
load average near 4, two threads turned a 148 ms time-to-first-token into 4,253 ms (issue 33); one thread did
not. The load average cannot say what the load will be, so this only warns, naming the flag, and changes
nothing.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def overload_warning(num_threads: int, load_average: float, cores: int) -> str | None:
    """The warning to give when `num_threads` threads will compete with `load_average` runnable processes
    for `cores` cores, or None.

    Runnable processes beyond the cores wait; when more than one of them would be waiting with this engine's
    threads added, the engine's ops stall on preempted threads. Fewer threads is only worth suggesting when
    there are fewer idle cores than threads (one thread is always allowed).
    """
    idle = max(1, int(cores - load_average))
    if num_threads <= idle or load_average + num_threads <= cores + 1:
        return None
    return (
        f"the machine's load average is {load_average:.1f} on {cores} CPU cores, and this engine runs "
        f"{num_threads} CPU threads: with the cores busy, each op waits for its slowest thread and can run "
        f"many times slower. Consider --num-threads {idle} (config key num_threads)."
    )


def check_thread_load(num_threads: int) -> str | None:
    """overload_warning() for this machine now; None where the load average is unavailable (Windows)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return overload_warning(num_threads, load, usable_cores())
