"""LLM.engine_info() and LLM.get_stats(): the public summary a tool or plugin reads instead of engine internals."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_model  # noqa: E402


def test_engine_info_describes_the_built_engine(tmp_path: Path) -> None:
    llm = LLM(make_tiny_model("llama", tmp_path), device="cpu", block_size=16, max_num_seqs=4, num_kv_blocks=64)
    try:
        info = llm.engine_info()
        assert info.block_size == 16 and info.num_kv_blocks == 64 and info.device == "cpu"
        assert info.dtype == "float32" and info.config.scheduler.max_num_seqs == 4
        assert info.components["loader"] == "hf" and info.components["scheduler"] == "fcfs"
        assert info.components["attention"] == "torch" and info.max_model_len > 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.block_size = 8  # type: ignore[misc]
        before = llm.get_stats().num_steps
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert llm.get_stats().num_steps >= before + 3
    finally:
        llm.shutdown()
