"""Run a kernel test file as a script under Triton's interpreter, in a child process: TRITON_INTERPRET must be
set before triton is imported, and the parent's triton is already imported for the tests' offline compiles."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from early_children import run_child, start_early


def _child(script: str, *args: str) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    return [sys.executable, script, *args], env


def start_interpreted_early(script: str, *args: str) -> None:
    """Declare (at the test file's import) the run_interpreted(script, *args) a fixture will make: it starts
    in the background once collection ends (tests/early_children.py)."""
    start_early(script, *_child(script, *args))


def run_interpreted(script: str, *args: str, timeout: int = 300) -> Any:
    """`python script *args` with TRITON_INTERPRET=1, one thread and tests/ on the path; the JSON its last line
    of output prints (the child's stderr in the failure message)."""
    proc = run_child(*_child(script, *args), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
