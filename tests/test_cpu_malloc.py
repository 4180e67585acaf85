"""core/platform/cpu_malloc.py: glibc's mmap and trim thresholds raised once per process, unless the user chose."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator

import pytest

from pagedllm.platform import cpu_malloc


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    saved = list(cpu_malloc._done)
    cpu_malloc._done.clear()
    yield
    cpu_malloc._done[:] = saved


def test_both_thresholds_are_set_once() -> None:
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    line = cpu_malloc.tune_malloc({}, mallopt)
    assert calls == [(-3, cpu_malloc.MMAP_THRESHOLD), (-1, cpu_malloc.TRIM_THRESHOLD)]
    assert line is not None and "32 MiB" in line and cpu_malloc.DISABLE_ENV in line
    assert cpu_malloc.tune_malloc({}, mallopt) == line and len(calls) == 2  # process-wide: once


@pytest.mark.parametrize(("env", "why"), [
    ({"PAGEDLLM_CPU_MALLOC": "0"}, "PAGEDLLM_CPU_MALLOC=0"),
    ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}, "GLIBC_TUNABLES is set"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded"),
])
def test_what_the_user_set_wins(env: dict[str, str], why: str) -> None:
    def mallopt(param: int, value: int) -> int:
        raise AssertionError("mallopt called")

    line = cpu_malloc.tune_malloc(env, mallopt)
    assert line is not None and why in line and "left as they are" in line


def test_a_refusal_is_reported() -> None:
    assert "refused" in str(cpu_malloc.tune_malloc({}, lambda param, value: 0))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_accepts_the_values() -> None:
    # The real mallopt takes both values (a glibc that refused them would answer 0).
    fn = ctypes.CDLL(None).mallopt
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    assert fn(-3, cpu_malloc.MMAP_THRESHOLD) == 1 and fn(-1, cpu_malloc.TRIM_THRESHOLD) == 1
