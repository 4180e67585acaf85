"""glibc malloc's two thresholds, set once per CPU engine process so a step's tensors reuse the heap's pages.

    tune_malloc()  -> the reason line for the start-up log, or None where nothing was changed (and why not is
                      in the line too, or there is no glibc)

NOTE 1: torch takes a CPU tensor's memory from malloc. glibc serves a request above M_MMAP_THRESHOLD with a
fresh mmap (zeroed pages, one fault each on first touch, unmapped again on free) and gives the heap's free top
back to the kernel above M_TRIM_THRESHOLD. Both start at 128 KiB and grow only with the largest chunk freed so
far, while a batch step allocates and frees tens of tensors of 1-13 MB (SmolLM2's 2048-token prefill:
[2048, 3072] bf16 gate_up outputs, float32 copies of the qkv / o / down products, attention scratch), so pages
were faulted in, zeroed and unmapped again every step. `pagedllm bench throughput --num-prompts 32
--input-len-range 32:256 --output-len 64 --num-threads 2` (2 shared cores, 2026-12-02 07:06 UTC, load ~1.4),
timed run only: 89,745 minor faults and 0.80 s of system time with glibc's defaults; 15,667 and 0.04 s with
both thresholds raised; raising only one made it worse (the trim threshold alone fixes the mmap threshold at
128 KiB: 1.8 M faults; the mmap threshold alone: 462 k). docs/cpu.md has the A B A B end to end.
NOTE 2: the cost is memory kept: up to TRIM_THRESHOLD of freed heap stays mapped for the next step instead of
going back between steps (the step had it mapped at its peak anyway). 32 MiB is the ceiling glibc's own
dynamic threshold grows to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), above a 2048-token step's largest tensor
(12 MB); larger allocations (the KV cache, weights) stay mmapped as before.
NOTE 3: what the user set wins: any of glibc's own MALLOC_*_ variables or GLIBC_TUNABLES, or another allocator
preloaded (tcmalloc, jemalloc: mallopt would tune a malloc nobody calls), and PAGEDLLM_CPU_MALLOC=0.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable, Mapping

MMAP_THRESHOLD = 32 << 20  # NOTE 2
TRIM_THRESHOLD = 512 << 20  # NOTE 2
DISABLE_ENV = "PAGEDLLM_CPU_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_USER_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
              "GLIBC_TUNABLES")
_done: list[str | None] = []  # the first call's answer: mallopt is process-wide, once is enough


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt (argtypes set), or None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    fn = ctypes.CDLL(None).mallopt
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn  # type: ignore[no-any-return]


def why_not_tuned(env: Mapping[str, str]) -> str | None:
    """The setting that leaves glibc's thresholds alone (NOTE 3), or None."""
    setting = env.get(DISABLE_ENV, "1")
    if setting.lower() in ("0", "false", "off", "no"):
        return f"{DISABLE_ENV}={setting}"
    user = [key for key in _USER_KEYS if env.get(key)]
    if user:
        return f"{user[0]} is set"
    preload = env.get("LD_PRELOAD", "")
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if name in preload:
            return f"{name} is preloaded"
    return None


def tune_malloc(
    env: Mapping[str, str] | None = None, mallopt: Callable[[int, int], int] | None = None
) -> str | None:
    """Raise glibc's mmap and trim thresholds (NOTE 1) unless the user chose otherwise (NOTE 3); the reason line
    for the start-up log, None without glibc. Once per process: later calls return the first one's line."""
    if _done:
        return _done[0]
    env = os.environ if env is None else env
    why_not = why_not_tuned(env)
    fn = mallopt if mallopt is not None else (None if why_not else _glibc_mallopt())
    if why_not is not None:
        line: str | None = f"malloc: glibc's thresholds left as they are ({why_not})"
    elif fn is None:
        line = None
    elif fn(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and fn(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
        line = (f"malloc: tensors up to {MMAP_THRESHOLD >> 20} MiB from the heap and up to {TRIM_THRESHOLD >> 20} "
                f"MiB of it kept between steps (glibc's mallopt; {DISABLE_ENV}=0 leaves glibc's defaults)")
    else:
        line = "malloc: glibc refused the thresholds (mallopt), its defaults stay"
    _done.append(line)
    return line
