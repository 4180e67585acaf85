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


def test_warm_up_kinds_beside_long_prompts(tmp_path: Path) -> None:
    """With a budget for a long prompt the warm-up adds the steps W1 compiled inside its timed run (NOTE 3):
    decodes beside a long fresh prompt at both decode entries' sizes, and decodes beside a later chunk and
    such a prompt; still only the null block is written, and greedy tokens do not change."""
    from pagedllm import LLM

    llm = LLM(make_tiny_model("llama", tmp_path), attention={"backend": "torch"}, device="cpu", dtype="float32",
              max_num_seqs=300, max_num_batched_tokens=1024, block_size=16, kv_cache_memory_gb=0.02)
    reference = _greedy(llm)
    runner = _runner(llm)
    before = [c.clone() for c in runner.kv_caches]
    kinds = runner.warm_up()
    assert "16 decodes beside a long prompt" in kinds and "256 decodes beside a long prompt" in kinds, kinds
    assert "16 decodes, a later chunk and a long prompt" in kinds, kinds
    for c, b in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(c[:, 1:], b[:, 1:])
    assert runner.compile_ahead() == 0  # CPU: nothing to compile
    assert _greedy(llm) == reference
    llm.shutdown()


def test_launch_only_compiles_inside_compiling_ahead() -> None:
    """layers/compile_ahead.launch: a plain launch outside the block; Triton's warmup (compile, no run) with
    the same grid and arguments inside it; the switch is off again after the block."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from pagedllm.layers import compile_ahead

    if not compile_ahead.available():
        pytest.skip("this triton has no AsyncCompileMode")
    calls: list[tuple[Any, ...]] = []

    class Kernel:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **kwargs: calls.append(("run", grid, args, kwargs))

        def warmup(self, *args: Any, grid: tuple[int, ...], **kwargs: Any) -> None:
            calls.append(("compile", grid, args, kwargs))

    compile_ahead.launch(Kernel(), (3, 2), 1, x=2)
    with compile_ahead.compiling_ahead(workers=2):
        compile_ahead.launch(Kernel(), (3, 2), 1, x=2)
    compile_ahead.launch(Kernel(), (1,), 5)
    assert calls == [("run", (3, 2), (1,), {"x": 2}), ("compile", (3, 2), (1,), {"x": 2}), ("run", (1,), (5,), {})]


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

    from pagedllm.plugins.attention.triton import backend as triton_backend
    from pagedllm.plugins.attention.triton import tuning as triton_tuning

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    names = {v: k for k, v in vars(triton_tuning).items() if isinstance(v, triton_tuning.AttentionConfig)}
    chosen: list[str] = []
    choose = triton_backend._decode_config  # every unified launch's config (choose_config's, or DECODE_BIG)

    def record(*args: Any) -> Any:
        cfg = choose(*args)
        chosen.append(names.get(cfg, repr(cfg)))
        return cfg

    with tempfile.TemporaryDirectory() as root:
        llm = _engine(make_tiny_model("llama", Path(root)), "triton")
        before = _greedy(llm)
        triton_backend._decode_config = record
        _runner(llm).warm_up()
        triton_backend._decode_config = choose
        equal = _greedy(llm) == before
        llm.shutdown()
    print(json.dumps({"configs": sorted(set(chosen)), "equal": equal}))


if __name__ == "__main__":
    _main()
