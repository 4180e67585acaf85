"""tests/early_children.py: a child started early gives the test what subprocess.run would have, failures and
timeouts included; one whose environment changed since it was declared runs again with the caller's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import early_children
import pytest


@pytest.fixture(autouse=True)
def _own_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """These cases' counts are not the session's (conftest.py reports a child run again)."""
    monkeypatch.setattr(early_children, "stats", dict.fromkeys(early_children.stats, 0))


def _declare_and_start(argv: list[str], env: dict[str, str]) -> None:
    """Declare the child and wait until the background thread has started it."""
    early_children.start_early(__file__, argv, env)
    early_children.start_background({Path(__file__).resolve()})
    child = early_children._declared[early_children._key(argv, env)]
    deadline = time.monotonic() + 30
    while not child.claimed:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_started_child_returns_its_exit_status_and_output() -> None:
    argv = [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"]
    env = {**os.environ, "EARLY_CHILD_CASE": "status"}
    _declare_and_start(argv, env)
    early = early_children.run_child(argv, env, timeout=60)
    assert early_children.stats["early"] == 1
    late = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (early.returncode, early.stdout, early.stderr) == (late.returncode, late.stdout, late.stderr) == (
        3, "out\n", "err\n")


def test_a_changed_environment_runs_the_child_again_with_the_callers() -> None:
    argv = [sys.executable, "-c", "import os; print(os.environ['EARLY_CHILD_CASE'])"]
    _declare_and_start(argv, {**os.environ, "EARLY_CHILD_CASE": "declared"})
    result = early_children.run_child(argv, {**os.environ, "EARLY_CHILD_CASE": "caller"}, timeout=60)
    assert result.stdout == "caller\n"
    assert early_children.stats == {"early": 0, "late": 0, "rerun": 1}


def test_the_timeout_counts_from_the_childs_start() -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    env = {**os.environ, "EARLY_CHILD_CASE": "timeout"}
    _declare_and_start(argv, env)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        early_children.run_child(argv, env, timeout=1)
    assert time.monotonic() - started < 10
