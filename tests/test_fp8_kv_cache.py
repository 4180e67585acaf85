"""FP8 (e4m3) KV cache: the torch and Triton backends against each other and against a 32-bit cache.

Two references: (1) the same attention over an fp32 cache -- fp8 must stay within a stated bound of it;
(2) the torch backend over the same fp8 cache -- the Triton kernel (Triton's CPU interpreter, in a child
process as tests/test_triton_attention.py explains) must write bit-identical pages and match its output
to float32 rounding. Then the engine: an fp8 cache holds twice the blocks of a float16 one in the same
memory, and a tiny model generates through it.

Bound (measured, then stated): e4m3 keeps 3 mantissa bits, so each stored K/V element carries up to 2^-4
relative rounding error (about 2.5 % rms for Gaussian data); attention averages over the context, and the
relative L2 error of the output measured 3.1-3.7 % on these random batches. The test allows 6 %.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest
import torch
from interpreter_child import run_interpreted

from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.worker.input_prep import prepare_inputs

FP8_VS_FP32_BOUND = 0.06
CASES: dict[str, tuple[list[int], list[int], dict[str, Any]]] = {
    # two decodes, a fresh prefill, a chunk after cached tokens; GQA
    "mixed": ([5, 8, 0, 5], [1, 1, 7, 6], {}),
    "split_kv": ([3, 30, 17], [1, 1, 1], {"segments": 4}),
    # non-unit per-tensor scales (powers of two: exact in both backends' arithmetic)
    "window_soft_cap_scaled": ([9, 0, 6], [1, 9, 5], {"window": 3, "soft_cap": 1.5, "k_scale": 0.5, "v_scale": 2.0}),
    "fp16_model": ([5, 8, 0, 5], [1, 1, 7, 6], {"dtype": "float16"}),
}


def _batch(contexts: list[int], queries: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> Any:
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    tables, used = [], 0
    for c, q in zip(contexts, queries, strict=True):
        n = -(-(c + q) // block_size)
        tables.append(perm[used : used + n])
        used += n
    decodes = 0
    while decodes < len(queries) and queries[decodes] == 1:
        decodes += 1
    return prepare_inputs([list(range(c + q)) for c, q in zip(contexts, queries, strict=True)],
                          contexts, queries, tables, block_size, torch.device("cpu"), decodes).attn


def _run(
    backend: Any, contexts: list[int], queries: list[int], cache_dtype: torch.dtype, *, dtype: str = "float32",
    window: int | None = None, soft_cap: float | None = None, segments: int | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer step: the context (random, stored through the backend's own write path) and this step's rows."""
    heads, kv_heads, head, block = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    num_blocks = sum(-(-(c + q) // block) for c, q in zip(contexts, queries)) + 3
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5, window, soft_cap)
    impl = backend.make_impl(layer)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    cache = torch.zeros(2, num_blocks, block, kv_heads, head, dtype=cache_dtype)
    # Earlier steps: write every cached token through the impl (a prefill of the contexts), then this step.
    total = [c + q for c, q in zip(contexts, queries)]
    history = torch.randn(sum(total), 2, kv_heads, head, generator=gen).to(dt)
    q_all = torch.randn(sum(total), heads, head, generator=gen).to(dt)
    first = _batch([0] * len(total), total, block, num_blocks, torch.Generator().manual_seed(seed))
    backend_md = backend.build_metadata(first)
    impl.forward(q_all, history[:, 0], history[:, 1], cache, backend_md)
    # Now the step itself: the last q tokens of each request again (rewritten with the same values).
    common = _batch(contexts, queries, block, num_blocks, torch.Generator().manual_seed(seed))
    starts = torch.tensor([0] + total).cumsum(0)
    rows = torch.cat([torch.arange(int(starts[i + 1]) - q, int(starts[i + 1])) for i, q in enumerate(queries)])
    md = backend.build_metadata(common)
    if segments is not None:
        md.num_segments = segments
    out = impl.forward(q_all[rows], history[rows, 0], history[rows, 1], cache, md)
    return out, cache


def _torch_backend() -> Any:
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend

    return TorchSDPABackend


@pytest.mark.parametrize("case", [c for c in CASES if c != "fp16_model"])
def test_torch_fp8_within_bound_of_fp32_cache(case: str) -> None:
    contexts, queries, opts = CASES[case]
    opts = {k: v for k, v in opts.items() if k != "segments"}
    fp8, cache = _run(_torch_backend(), contexts, queries, torch.float8_e4m3fn, **opts)
    ref, _ = _run(_torch_backend(), contexts, queries, torch.float32, **opts)
    assert cache.dtype == torch.float8_e4m3fn and torch.isfinite(cache.float()).all()
    rel = float((fp8 - ref).norm() / ref.norm())
    assert 0 < rel < FP8_VS_FP32_BOUND, rel


def test_fp8_store_saturates_instead_of_overflowing() -> None:
    from pagedllm.plugins.attention.torch_sdpa.backend import _store

    flat = torch.zeros(4, 1, 2, dtype=torch.float8_e4m3fn)
    _store(flat, torch.tensor([1]), torch.tensor([[[1000.0, -3.0]]]), scale=2.0)
    assert flat[1].float().tolist() == [[448.0, -1.5]]  # 1000 / 2 saturates at e4m3's largest finite value


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return dict(run_interpreted(__file__, timeout=400))


@pytest.mark.parametrize("case", list(CASES))
def test_triton_fp8_matches_torch_fp8(interp: dict[str, Any], case: str) -> None:
    res = interp[case]
    assert res["cache_equal"], "the Triton and torch writes of the fp8 pages must be bit-identical"
    assert res["nan"] == 0
    # float32 model: exact arithmetic up to summation order; float16: P is rounded to fp16 for the 2nd dot.
    assert res["rel"] < (5e-3 if CASES[case][2].get("dtype") == "float16" else 1e-5), res


def test_engine_fp8_greedy_triton_equals_torch(interp: dict[str, Any]) -> None:
    assert interp["engine"]["backends"] == ["torch", "triton"]
    assert interp["engine"]["equal"], interp["engine"]


def test_engine_fp8_doubles_the_blocks_of_float16_and_generates(tiny_root: Any) -> None:
    from tiny_models import make_tiny_model

    from pagedllm import LLM, SamplingParams

    path = make_tiny_model("llama", tiny_root)
    blocks = {}
    for cache_dtype in ("auto", "fp8"):
        llm = LLM(path, device="cpu", dtype="float16", kv_cache_memory_gb=0.01, kv_cache_dtype=cache_dtype)
        parts = llm.engine.parts
        blocks[cache_dtype] = parts.num_blocks
        if cache_dtype == "fp8":
            assert parts.runner.kv_caches[0].dtype == torch.float8_e4m3fn
            assert parts.selections["attention"].winner.name == "torch"
        llm.shutdown()
    # One page of K and V: 2 x 16 tokens x 2 KV heads x 16 dims x 2 layers = 2048 elements (x2 bytes in fp16).
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1), blocks

    llm = LLM(path, device="cpu", dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=8, block_size=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 15))}, {"prompt_token_ids": [5, 6, 7]}], params,
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    llm.shutdown()


def test_config_names_the_bad_cache_dtype() -> None:
    from pagedllm.config import ConfigError, EngineConfig

    assert EngineConfig.model_validate({"kv_cache": {"cache_dtype": "FP8"}}).kv_cache.cache_dtype == "fp8_e4m3"
    with pytest.raises((ConfigError, ValueError), match="cache_dtype"):
        EngineConfig.model_validate({"kv_cache": {"cache_dtype": "int4"}})


def _engine_case() -> dict[str, Any]:
    """Greedy tokens with an fp8 cache: the Triton kernel (interpreted) and the torch backend agree."""
    import tempfile
    from pathlib import Path

    from pagedllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as root:
        path = make_tiny_model("qwen3", Path(root))
        prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 3 + 7 * i + n))} for i, n in enumerate((5, 14))]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
        tokens = {}
        for backend in ("torch", "triton"):
            llm = LLM(path, attention={"backend": backend}, device="cpu", dtype="float32", kv_cache_dtype="fp8",
                      max_num_seqs=2, max_num_batched_tokens=8, block_size=4)
            chosen = llm.engine.parts.selections["attention"].winner.name
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[chosen] = [list(o.outputs[0].token_ids) for o in outs]
            llm.shutdown()
    return {"backends": sorted(tokens), "equal": tokens.get("torch") == tokens.get("triton"), "tokens": tokens}


def _main() -> None:
    """Child process: every case under the interpreter, one JSON line on stdout."""
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, (contexts, queries, opts) in CASES.items():
        got, cache = _run(TritonBackend, contexts, queries, torch.float8_e4m3fn, **opts)
        ref, ref_cache = _run(_torch_backend(), contexts, queries, torch.float8_e4m3fn,
                              **{k: v for k, v in opts.items() if k != "segments"})
        results[name] = {
            "nan": int(torch.isnan(got).sum()),
            "rel": float((got.float() - ref.float()).norm() / ref.float().norm()),
            "cache_equal": bool(torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))),
        }
    results["engine"] = _engine_case()
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
