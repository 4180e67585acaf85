"""Child processes that start before the test that needs them, so they run beside the tests before it.

The Triton-interpreter children (one per kernel test file, 10-35 s each on one thread) are independent of
every other test: the parent only waits for their JSON. A test file declares its child at import time with
`start_early(__file__, argv, env)`; once collection ends, conftest.py's hook starts the declared children of
the collected files one at a time in a background thread (the second of the CI machine's two cores), and the
fixture gets the child's result through `run_child`, exactly as `subprocess.run` would have given it. A
child that has not started when its test needs it runs there and then, as before; one whose environment
differs from the declared one (a test changed os.environ for good) is run again with the caller's.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# Set by pytest for each test phase; no child reads it, and it differs between collection and the test.
_VOLATILE = ("PYTEST_CURRENT_TEST",)


def _key(argv: list[str], env: dict[str, str]) -> tuple[tuple[str, ...], frozenset[tuple[str, str]]]:
    return tuple(argv), frozenset((k, v) for k, v in env.items() if k not in _VOLATILE)


@dataclass
class _Child:
    owner: Path  # the test file that declared it: started only when that file's tests were collected
    argv: list[str]
    env: dict[str, str]
    claimed: bool = False  # started by the background thread, or taken over by the test that needs it
    started: float = 0.0
    proc: subprocess.Popen[str] | None = None
    result: subprocess.CompletedProcess[str] | None = None
    done: threading.Event = field(default_factory=threading.Event)


_lock = threading.Lock()
_declared: dict[tuple[tuple[str, ...], frozenset[tuple[str, str]]], _Child] = {}
_stopping = threading.Event()
stats = {"early": 0, "late": 0, "rerun": 0}  # reported by conftest.py when something went unused


def start_early(owner: str, argv: list[str], env: dict[str, str]) -> None:
    """Declare `argv` (run with exactly `env`) as a child a test of `owner` will ask run_child for."""
    with _lock:
        _declared.setdefault(_key(argv, env), _Child(Path(owner).resolve(), list(argv), dict(env)))


def start_background(collected: set[Path]) -> None:
    """Run the declared children of the `collected` test files, one at a time, in a daemon thread."""
    children = [c for c in _declared.values() if c.owner in collected]
    if children:
        threading.Thread(target=_run_in_order, args=(children,), name="early-children", daemon=True).start()


def stop_background() -> None:
    """Start no more children and kill the running ones (the session is ending)."""
    _stopping.set()
    with _lock:
        running = [c.proc for c in _declared.values() if c.proc is not None and not c.done.is_set()]
    for proc in running:
        proc.kill()


def _run_in_order(children: list[_Child]) -> None:
    for child in children:
        with _lock:
            if child.claimed or _stopping.is_set():
                continue
            child.claimed, child.started = True, time.monotonic()
            try:
                child.proc = subprocess.Popen(child.argv, env=child.env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)
            except OSError:  # run_child runs it itself (and reports what fails)
                child.done.set()
                continue
        try:
            out, err = child.proc.communicate()
            child.result = subprocess.CompletedProcess(child.argv, child.proc.returncode, out, err)
        finally:
            child.done.set()


def run_child(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)`, from the child
    start_early declared where it is running or done (the timeout counts from its start)."""
    key = _key(argv, env)
    with _lock:
        child = _declared.pop(key, None)
        early = child is not None and child.claimed
        if child is not None and not early:
            child.claimed = True  # not started yet: run it here, and the background thread skips it
        if child is None and any(tuple(c.argv) == tuple(argv) for c in _declared.values()):
            stats["rerun"] += 1
    if not early:
        stats["late"] += child is not None
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert child is not None
    if not child.done.wait(max(0.0, timeout - (time.monotonic() - child.started))):
        assert child.proc is not None
        child.proc.kill()
        child.done.wait()
        partial = child.result
        raise subprocess.TimeoutExpired(argv, timeout, partial and partial.stdout, partial and partial.stderr)
    if child.result is None:  # it could not start in the background
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    stats["early"] += 1
    return child.result

