"""README's first command installs no triton (the `server` extra, a CPU torch): the engine must build and
generate on the CPU with triton impossible to import, through every plugin a CPU engine loads (the unquantized
and GGUF methods import the kernel toolkit, pagedllm.api.kernels, whose Triton names load on first use)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tiny_models import make_tiny_model

CHILD = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError, as on an install without it
from pagedllm import LLM, SamplingParams
import pagedllm.api.kernels as kernels
assert not kernels.triton_available()
llm = LLM(sys.argv[1], device="cpu", block_size=4)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
print("TOKENS", list(out[0].outputs[0].token_ids))
print("TRITON", "triton" in sys.modules and sys.modules["triton"] is not None)
"""


def test_cpu_engine_builds_and_generates_without_triton(tiny_root: Path) -> None:
    model = make_tiny_model("llama", tiny_root)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("TOKENS", "TRITON")))
    assert len(ast.literal_eval(lines["TOKENS"])) == 6
    assert lines["TRITON"] == "False"
