"""Run a snippet that compiles Triton kernels for sm_90 with no GPU (triton.compile + GPUTarget), as the tests'
offline compile checks do: in a child process without TRITON_INTERPRET (the interpreter would not compile)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def compile_offline(code: str) -> str:
    """Run `code` (which prints 'ok' when every kernel compiled) in a child; skip where triton cannot. Returns
    the child's stdout (register counts and the like, for the test to show)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton has no offline compile API ({exc})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
    return proc.stdout
