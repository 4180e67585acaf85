"""Run a kernel test file as a script under Triton's interpreter, in a child process: TRITON_INTERPRET must be
set before triton is imported, and the parent's triton is already imported for the tests' offline compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_interpreted(script: str, *args: str, timeout: int = 300) -> Any:
    """`python script *args` with TRITON_INTERPRET=1, one thread and tests/ on the path; the JSON its last line
    of output prints (the child's stderr in the failure message)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
