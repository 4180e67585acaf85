"""The runner's start-up warm-up (model_runner NOTE 3): each kind of step once, on the null block only.

(1) torch backend, in process: the warm-up writes only block 0 of the KV cache, and an engine's greedy tokens
are the same after it (the second run reads the first one's blocks through the prefix cache). (2) triton backend under Triton's CPU interpreter, in a child process (tests/
test_triton_attention.py explains why): the warm-up's steps reach every entry of the attention kernel's
launch table -- the point of it, since each entry is a separate JIT compile on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from interpreter_child import run_interpreted  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 11)]


def _runner(llm: Any) -> Any:
    core = llm.engine.core
    return core.runner if hasattr(core, "runner") else core.executor.runner


def _engine(path: str, backend: str) -> Any:
    from pagedllm import LLM

    return LLM(path, attention={"backend": backend}, device="cpu", dtype="float32", max_num_seqs=8,
               max_num_batched_tokens=256, block_size=16, kv_cache_memory_gb=0.01)


def _greedy(llm: Any) -> list[list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_warm_up_writes_only_the_null_block_and_changes_no_output(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path)
    llm = _engine(path, "torch")
    reference = _greedy(llm)
    runner = _runner(llm)
    caches = runner.kv_caches  # now holding the prompts' K/V, which the prefix cache will reuse below
    before = [c.clone() for c in caches]
    kinds = runner.warm_up()
    assert len(kinds) == 5, kinds
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 1:], b[:, 1:])  # real requests' blocks untouched
    assert any(not torch.equal(c[:, 0], b[:, 0]) for c, b in zip(caches, before, strict=True))  # it ran
    assert _greedy(llm) == reference
    llm.shutdown()


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return dict(run_interpreted(__file__, timeout=600))


def test_warm_up_reaches_every_triton_launch_configuration(interp: dict[str, Any]) -> None:
    assert {"DECODE", "DECODE_WIDE", "MIXED", "PREFILL"} <= set(interp["configs"]), interp
    assert interp["equal"], interp


def _main() -> None:
    """Child: the triton engine's warm-up with choose_config recorded; greedy tokens before and after."""
    import json
    import tempfile

    from pagedllm.plugins.attention import triton_kernels, triton_tuning

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    names = {id(v): k for k, v in vars(triton_tuning).items() if isinstance(v, triton_tuning.AttentionConfig)}
    chosen: list[str] = []
    choose = triton_kernels.choose_config

    def record(*args: Any) -> Any:
        cfg = choose(*args)
        chosen.append(names.get(id(cfg), repr(cfg)))
        return cfg

    with tempfile.TemporaryDirectory() as root:
        llm = _engine(make_tiny_model("llama", Path(root)), "triton")
        before = _greedy(llm)
        triton_kernels.choose_config = record
        _runner(llm).warm_up()
        triton_kernels.choose_config = choose
        equal = _greedy(llm) == before
        llm.shutdown()
    print(json.dumps({"configs": sorted(set(chosen)), "equal": equal}))


if __name__ == "__main__":
    _main()
