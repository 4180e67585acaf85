"""Run a snippet that compiles Triton kernels for sm_90 with no GPU (triton.compile + GPUTarget), as the tests'
offline compile checks do: in a child process without TRITON_INTERPRET (the interpreter would not compile)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Source for a child's snippet (prepend it): ptxas for sm_90a on a kernel triton.compile returned.
PTXAS_SM90A = """
def ptxas_sm90a(kernel):
    \"\"\"Assemble kernel.asm['ptx'] for sm_90a; assert no spills; the 'Used N registers' line (None where
    triton ships no ptxas-blackwell: its plain ptxas (8.8) is older than the PTX this triton writes).\"\"\"
    import os, re, subprocess, tempfile
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas-blackwell')
    if not os.path.exists(ptxas):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        open(os.path.join(tmp, 'k.ptx'), 'w').write(kernel.asm['ptx'])
        r = subprocess.run([ptxas, '-arch=sm_90a', '-v', os.path.join(tmp, 'k.ptx'), '-o',
                            os.path.join(tmp, 'k.cubin')], capture_output=True, text=True)
    assert r.returncode == 0 and '0 bytes spill stores' in r.stderr, r.stderr
    return re.search(r'Used \\d+ registers', r.stderr).group(0)
"""


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
