"""The Triton backend against the torch oracle, run by Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before `triton` itself is imported: `@triton.jit` decides at decoration time
whether a function is compiled or interpreted, and triton.language's own helpers (tl.max, tl.sum, ...) are
decorated when triton is first imported. Any earlier import in the pytest process (another test, torch's
inductor) would leave them compiled. So the kernel cases run in ONE child process started with
TRITON_INTERPRET=1 (this file run as a script); the tests read its JSON. That also keeps the variable out
of the parent, where it would let the triton backend pass check() on the CPU for every later test.
Shapes stay tiny: the interpreter runs each program in numpy. bf16 is skipped here (the interpreter's bf16
arithmetic is not the GPU's); examples/gpu/h200_check.py covers it on the H200.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
from offline_compile import compile_offline

from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.worker.input_prep import prepare_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# name -> (contexts, queries, options, tolerance on ||got - ref|| / ||ref||). float32 is exact float32 in
# the interpreter (1e-5); float16 rounds P and the inputs (5e-3).
CASES: dict[str, tuple[list[int], list[int], dict[str, Any], float]] = {
    # two decodes (contexts 6 and 9: partial last blocks), a fresh prefill, a chunk after 5 cached tokens
    "mixed_gqa_fp32": ([5, 8, 0, 5], [1, 1, 7, 6], {}, 1e-5),
    "mixed_gqa_fp16": ([5, 8, 0, 5], [1, 1, 7, 6], {"dtype": "float16"}, 5e-3),
    "split_kv_4": ([3, 30, 17], [1, 1, 1], {"segments": 4}, 1e-5),
    # more segments than the merge's chunk (32): the running maximum across chunks, empty segments of short rows
    "split_kv_40_fp16": ([3, 150, 70], [1, 1, 1], {"segments": 40, "dtype": "float16"}, 5e-3),
    "split_kv_policy": ([3, 30, 17], [1, 1, 1], {"seed": 1}, 1e-5),  # 4 "SMs" on the CPU: splits
    "window": ([9, 0, 6], [1, 9, 5], {"window": 5}, 1e-5),
    "soft_cap": ([9, 0, 6], [1, 9, 5], {"soft_cap": 2.0}, 1e-5),
    "window_soft_cap_fp16": ([9, 0, 6], [1, 9, 5], {"window": 3, "soft_cap": 1.5, "dtype": "float16"}, 5e-3),
    "window_split": ([13, 20], [1, 1], {"window": 5, "segments": 2}, 1e-5),
    # 8 query heads on one KV head, head size not a power of two, page 16
    "mqa_head24_page16": ([0, 20], [12, 3], {"heads": 8, "kv_heads": 1, "head": 24, "block_size": 16}, 1e-5),
    # a long chunk: several query blocks in one request, keys spanning several tiles
    "long_chunk": ([11, 0], [1, 40], {"heads": 2, "kv_heads": 2}, 1e-5),
    # >= 128 new tokens per request: the PREFILL entry (128 rows, reversed blocks, K as rows), a decode beside
    "prefill_rule": ([9, 0, 5], [1, 250, 140], {}, 1e-5),
    # the same batch through PREFILL's other layouts: one head per program, K gathered transposed, in order
    "prefill_per_head_window_fp16": ([9, 0, 5], [1, 250, 140], {
        "window": 37, "dtype": "float16", "prefill": {"pack_gqa": False, "k_rows": False, "reverse": False}}, 5e-3),
    "prefill_soft_cap": ([0, 7], [200, 90], {"soft_cap": 2.0, "prefill": {"k_rows": False}}, 1e-5),
    # the heads-first launch order (grid axes swapped), packed GQA with reversed blocks and one head per program
    "prefill_heads_first": ([9, 0, 5], [1, 250, 140], {"prefill": {"heads_first": True}}, 1e-5),
    "prefill_per_head_heads_first": ([9, 0, 5], [1, 250, 140], {
        "prefill": {"heads_first": True, "pack_gqa": False, "reverse": False}}, 1e-5),
    # triton/backend.py NOTE 5: the decodes as their own launch, the rest over views from request 3 on (a fresh
    # prompt, a chunk after cached tokens), and with the rest under the PREFILL rule
    "split_decodes_mixed": ([5, 8, 12, 0, 5], [1, 1, 1, 7, 6], {"split_decodes": 3}, 1e-5),
    "split_decodes_prefill_fp16": ([9, 20, 0, 5], [1, 1, 250, 140], {"split_decodes": 2, "dtype": "float16"},
                                   5e-3),
}


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_torch(interp: dict[str, Any], case: str) -> None:
    res = interp[case]
    assert res["nan"] == 0
    assert res["cache_equal"], "reshape_and_cache must write exactly the torch backend's slots"
    assert res["rel"] < CASES[case][3], res


def test_padding_slots_skipped(interp: dict[str, Any]) -> None:
    assert interp["padding"] == {"written": True, "others_untouched": True}


@pytest.mark.parametrize("variant", ["shared_80", "shared_80_split2", "unaligned_70", "off", "all_share",
                                     "scattered"])
def test_cascade_against_torch(interp: dict[str, Any], variant: str) -> None:
    """Cascade decode (a shared prefix read once by the prefix kernel) equals the torch backend's attention."""
    res = interp["cascade"][variant]
    assert res["nan"] == 0 and res["rel"] < 1e-5, res


@pytest.mark.parametrize("variant", ["shared_80", "shared_80_split2", "off", "scattered"])
def test_merge_with_several_heads_per_program(interp: dict[str, Any], variant: str) -> None:
    """The merge kernel's large-batch form (HEADS > 1, forced on these small batches) gives the same attention."""
    res = interp["cascade_merge_heads"][variant]
    assert res["nan"] == 0 and res["rel"] < 1e-5, res
    split = interp["split_merge_heads"]
    assert split["nan"] == 0 and split["rel"] < 1e-5, split


def test_cascade_prefix_detection() -> None:
    from pagedllm.worker.cuda_graphs import shared_prefix
    from pagedllm.worker.input_prep import plan_inputs

    shared = list(range(1, 21))  # 20 blocks of 16 = 320 tokens
    # requests 0, 2, 3 share; 1 has a prefix of its own
    blocks = [shared + [100], [200 + j for j in range(21)], shared + [101], shared[:19] + [300, 102]]
    lens = [330, 330, 325, 321]
    host = plan_inputs([list(range(n)) for n in lens], [n - 1 for n in lens], [1] * 4, blocks, 16, 4)
    tokens, src, flags = shared_prefix(host)
    assert (tokens, src, flags.tolist()) == (19 * 16, 0, [1, 0, 1, 1])  # request 3 parts after 19 blocks
    lone = plan_inputs([list(range(n)) for n in lens[:2]], [n - 1 for n in lens[:2]], [1] * 2, blocks[:2], 16, 2)
    assert shared_prefix(lone)[0] == 0  # two different first blocks: nobody shares
    short = plan_inputs([list(range(n)) for n in (100, 101)], [99, 100], [1, 1], [shared[:7]] * 2, 16, 2)
    assert shared_prefix(short)[0] == 0  # under CASCADE_MIN_TOKENS


def test_decode_wide_config(interp: dict[str, Any]) -> None:
    """The decode entry measured fastest on the H200 (64-key tiles), run at its own tile size; then in the
    heads-first launch order, with one segment and split three ways."""
    for key in ("decode_wide", "decode_wide_heads_first", "decode_wide_heads_first_split"):
        assert interp[key]["nan"] == 0 and interp[key]["rel"] < 1e-5, (key, interp[key])


def test_decode_big_config(interp: dict[str, Any]) -> None:
    """triton_tuning.DECODE_BIG (128-key tiles) at its own tile, plain and as a cascade's suffix kernel, whose
    shared prefix is then rounded to 128 keys (208 shared -> 128; 100 -> no cascade), against torch."""
    for name, got in interp["decode_big"].items():
        assert got["nan"] == 0 and got["rel"] < 1e-5, (name, got)


def test_engine_greedy_tokens_match_torch(interp: dict[str, Any]) -> None:
    assert interp["engine"] == {"backends": ["torch", "triton"], "equal": True}


def _batch(
    contexts: list[int], queries: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> tuple[object, list[list[int]]]:
    """Common metadata for requests with `contexts[i]` cached tokens and `queries[i]` new ones, random blocks."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    block_ids, used = [], 0
    for c, q in zip(contexts, queries, strict=True):
        n = -(-(c + q) // block_size)
        block_ids.append(perm[used : used + n])
        used += n
    num_decodes = 0
    while num_decodes < len(queries) and queries[num_decodes] == 1:
        num_decodes += 1
    inputs = prepare_inputs(
        [list(range(c + q)) for c, q in zip(contexts, queries, strict=True)],
        contexts, queries, block_ids, block_size, torch.device("cpu"), num_decodes,
    )
    return inputs.attn, block_ids


def _run_both(
    contexts: list[int],
    queries: list[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head: int = 16,
    block_size: int = 4,
    dtype: str = "float32",
    window: int | None = None,
    soft_cap: float | None = None,
    segments: int | None = None,
    seed: int = 0,
    prefill: dict[str, Any] | None = None,
    split_decodes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both backends on one random batch; `prefill` overrides fields of triton_tuning.PREFILL for the call."""
    from dataclasses import replace

    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.attention.triton import tuning as triton_tuning
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(contexts, queries)) + 3
    common, _ = _batch(contexts, queries, block_size, num_blocks, gen)
    tokens = sum(queries)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, generator=gen).to(dt)
    q = torch.randn(tokens, heads, head, generator=gen).to(dt)
    # k/v as the model passes them: views into a fused qkv row, last dim contiguous, rows strided.
    kv = torch.randn(tokens, 2 * kv_heads * head + 8, generator=gen).to(dt)
    k = kv[:, : kv_heads * head].view(tokens, kv_heads, head)
    v = kv[:, kv_heads * head : 2 * kv_heads * head].view(tokens, kv_heads, head)
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5, window, soft_cap)

    ref_cache = cache.clone()
    ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    md = TritonBackend.build_metadata(common)
    md.num_segments = segments
    md.split_decodes = split_decodes
    default = triton_tuning.PREFILL
    triton_tuning.PREFILL = replace(default, **(prefill or {}))
    try:
        got = TritonBackend.make_impl(layer).forward(q, k, v, cache, md)
    finally:
        triton_tuning.PREFILL = default
    return got, ref, cache, ref_cache


def test_check_only_with_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.plugins.attention.triton import _check

    ctx = AttentionSelectionContext("cpu", None, "float32", "auto", 64, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _check(ctx)  # a normal CPU run never picks the kernel backend
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _check(ctx) == []
    assert _check(AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16)) == []
    assert _check(AttentionSelectionContext("cuda", (7, 5), "float16", "auto", 128, 16))


def test_split_policy() -> None:
    from pagedllm.plugins.attention.triton.backend import choose_segments

    # Split only below 2 programs per SM (triton/backend.py NOTE 2): 64 x 8 = 512 programs fill 132 SMs unsplit.
    assert choose_segments(64, 8, 132) == 1
    assert choose_segments(32, 8, 132) == 2  # 256 programs < 264
    assert choose_segments(8, 8, 132) == 8  # long-context small batches still split
    assert choose_segments(1, 8, 132) == 32  # one request: the most segments
    assert choose_segments(256, 8, 132) == 1


def test_config_rule() -> None:
    """Launch configurations by new tokens per request (triton_tuning's table)."""
    from pagedllm.plugins.attention.triton.tuning import (
        DECODE,
        DECODE_BIG,
        DECODE_WIDE,
        MIXED,
        PREFILL,
        choose_config,
    )

    assert choose_config(8 * 2048, 8, 1) is PREFILL
    assert choose_config(391, 3, 1) is PREFILL  # the prefill_rule case above
    assert choose_config(4 * 2048 + 256, 4 + 256, 1) is MIXED  # prefills beside many decodes
    assert choose_config(64, 64, 1) is DECODE_WIDE and choose_config(3 * 64, 64, 1) is DECODE_WIDE  # spec k = 2
    assert choose_config(64, 64, 4) is DECODE  # split-KV keeps the narrow tile
    # DECODE_BIG (128-key tiles) is the backend's choice by batch size (plugins.triton.decode_big_min_seqs)
    assert choose_config(500, 500, 1) is DECODE_WIDE and DECODE_BIG.tile_n == 128
    assert choose_config(8 * 2048, 8, 2) is DECODE  # split-KV only for decode steps


def test_decode_config_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plugins.triton.decode_big_min_seqs` sends decode-only, unsplit steps of that many requests to DECODE_BIG
    (0: never; negative: refused by the options model); `decode_heads_first: false` gives the decode entries
    the default launch order and leaves every other field as the table has it."""
    from pagedllm.plugins.attention import triton as plugin
    from pagedllm.plugins.attention.triton.backend import _decode_config
    from pagedllm.plugins.attention.triton.tuning import DECODE, DECODE_BIG, DECODE_WIDE, MIXED

    never = plugin.TritonOptions(decode_big_min_seqs=0)
    assert _decode_config(512, 512, 1, never) is DECODE_WIDE
    big = plugin.TritonOptions(decode_big_min_seqs=256)
    assert _decode_config(256, 256, 1, big) is DECODE_BIG
    assert _decode_config(255, 255, 1, big) is DECODE_WIDE  # too few requests
    assert _decode_config(512, 256, 1, big) is DECODE_WIDE  # two tokens per request (speculative steps): not measured
    assert _decode_config(256, 256, 2, big) is DECODE  # split-KV keeps DECODE
    assert _decode_config(4096, 256, 1, big) is MIXED
    assert DECODE_WIDE.heads_first and DECODE_BIG.heads_first
    not_first = plugin.TritonOptions(decode_big_min_seqs=256, decode_heads_first=False)
    assert _decode_config(256, 256, 1, not_first) == replace(DECODE_BIG, heads_first=False)
    assert _decode_config(100, 100, 1, not_first) == replace(DECODE_WIDE, heads_first=False)
    with pytest.raises(Exception, match="decode_big_min_seqs"):
        plugin.TritonOptions(decode_big_min_seqs=-1)


def test_split_decodes_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plugins.triton.split_decodes_min` splits a step with prompt tokens and that many decodes (NOTE 5); never a
    decode-only step, never below the threshold, never when 0 (the default). The rebased offsets start at 0."""
    from pagedllm.plugins.attention import triton as plugin
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    gen = torch.Generator().manual_seed(0)
    mixed, _ = _batch([5, 8, 12, 0], [1, 1, 1, 7], 4, 16, gen)
    decodes, _ = _batch([5, 8, 12], [1, 1, 1], 4, 16, gen)
    assert TritonBackend.build_metadata(mixed).split_decodes is None
    three = TritonBackend.configure(plugin.TritonOptions(split_decodes_min=3))
    md = three.build_metadata(mixed)
    assert md.split_decodes == 3 and md.rest_query_start_loc().tolist() == [0, 7]
    assert three.build_metadata(decodes).split_decodes is None
    four = TritonBackend.configure(plugin.TritonOptions(split_decodes_min=4))
    assert four.build_metadata(mixed).split_decodes is None
    # Two configured backends in one process keep their own options (one per engine, no module global).
    assert three.options.split_decodes_min == 3 and four.options.split_decodes_min == 4
    assert TritonBackend.options.split_decodes_min == 0 and three.name == four.name == "triton"


def _padding_case() -> dict[str, bool]:
    from pagedllm.api.kernels import reshape_and_cache

    cache = torch.randn(2, 3, 4, 1, 16)
    before = cache.clone()
    k = torch.randn(2, 1, 16)
    reshape_and_cache(k, k + 1, cache, torch.tensor([5, -1]))
    flat, old = cache.view(2, -1, 16), before.view(2, -1, 16)
    keep = torch.ones(12, dtype=torch.bool)
    keep[5] = False
    return {
        "written": bool(torch.equal(flat[0, 5], k[0, 0]) and torch.equal(flat[1, 5], k[0, 0] + 1)),
        "others_untouched": bool(torch.equal(flat[:, keep], old[:, keep])),
    }


def _cascade_case() -> dict[str, dict[str, float]]:
    """Decode batches where some requests share their first 5 blocks (80 tokens, page 16)."""
    from dataclasses import replace

    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    heads, kv_heads, head, bs = 4, 2, 16, 16
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5)
    results = {}
    # variant -> (shared prefix tokens told to the kernels, which requests share, suffix segments)
    variants = {"shared_80": (80, [1, 1, 1, 1, 0, 0], None), "shared_80_split2": (80, [1, 1, 1, 1, 0, 0], 2),
                "unaligned_70": (70, [1, 1, 1, 1, 0, 0], None), "off": (0, [1, 1, 1, 1, 0, 0], None),
                "all_share": (80, [1] * 6, None), "scattered": (80, [0, 1, 0, 1, 1, 0], None)}
    for name, (told, share, segments) in variants.items():
        gen = torch.Generator().manual_seed(3)
        extra = [3, 17, 40, 1, 22, 9]
        shared = list(range(1, 6))
        nxt = 6
        block_ids, contexts = [], []
        for i, e in enumerate(extra):
            ctx = 80 + e
            own = -(-(ctx + 1) // bs)
            mine = own - 5 if share[i] else own  # blocks of its own after the shared ones
            ids = (shared if share[i] else []) + list(range(nxt, nxt + mine))
            nxt += mine
            block_ids.append(ids)
            contexts.append(ctx)
        num_blocks = nxt + 1
        inputs = prepare_inputs([list(range(c + 1)) for c in contexts], contexts, [1] * len(contexts), block_ids,
                                bs, torch.device("cpu"), len(contexts))
        common = inputs.attn
        tokens = len(contexts)
        cache = torch.randn(2, num_blocks, bs, kv_heads, head, generator=gen)
        q = torch.randn(tokens, heads, head, generator=gen)
        k = torch.randn(tokens, kv_heads, head, generator=gen)
        v = torch.randn(tokens, kv_heads, head, generator=gen)
        ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, cache.clone(), TorchSDPABackend.build_metadata(common))
        cascade = torch.tensor([told, share.index(1), *share], dtype=torch.int32)
        md = TritonBackend.build_metadata(replace(common, cascade=cascade))
        md.num_segments = segments
        got = TritonBackend.make_impl(layer).forward(q, k, v, cache, md)
        results[name] = {"nan": int(torch.isnan(got).sum()), "rel": float((got - ref).norm() / ref.norm())}
    return results


def _engine_case() -> dict[str, Any]:
    """Greedy tokens of a tiny Qwen3-shaped model (GQA, head 32) through the whole engine, triton vs torch.

    Prompt lengths and the token budget force chunked prefill and mixed prefill+decode steps.
    """
    import tempfile
    from pathlib import Path

    from pagedllm import LLM, SamplingParams
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import make_tiny_model

    pm = get_plugin_manager()
    if pm.get(PluginKind.ATTENTION, "triton") is None:  # until pyproject.toml has the entry point
        import pagedllm.plugins.attention.triton as plugin

        pm.register(plugin, "triton-in-tree")
    with tempfile.TemporaryDirectory() as root:
        path = make_tiny_model("qwen3", Path(root))
        prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 3 + 7 * i + n))} for i, n in enumerate((5, 23, 2))]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
        tokens = {}
        for backend in ("torch", "triton"):
            llm = LLM(path, attention={"backend": backend}, device="cpu", dtype="float32",
                      max_num_seqs=2, max_num_batched_tokens=12, block_size=4)
            chosen = llm.engine.parts.selections["attention"].winner.name
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[chosen] = [list(o.outputs[0].token_ids) for o in outs]
            llm.shutdown()
    return {"backends": sorted(tokens), "equal": tokens.get("torch") == tokens.get("triton")}


def _decode_wide_case(heads_first: bool = False, segments: int = 1) -> dict[str, float]:
    """triton_tuning.DECODE_WIDE (64-key tiles, 2 stages) on decodes whose contexts end inside, at and just
    past a tile, page 16, GQA 4:1, float32 (the interpreter otherwise runs its own 16-key tile)."""
    from dataclasses import replace

    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.attention.triton.kernels import unified_attention
    from pagedllm.plugins.attention.triton.tuning import DECODE_WIDE

    gen = torch.Generator().manual_seed(3)
    contexts, heads, kv_heads, head, page = [0, 14, 62, 63, 64, 129], 8, 2, 32, 16
    n = len(contexts)
    num_blocks = sum(-(-(c + 1) // page) for c in contexts) + 3
    common, _ = _batch(contexts, [1] * n, page, num_blocks, gen)
    cache = torch.randn(2, num_blocks, page, kv_heads, head, generator=gen)
    q, k, v = (torch.randn(n, h, head, generator=gen) for h in (heads, kv_heads, kv_heads))
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5, None, None)
    ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, cache, TorchSDPABackend.build_metadata(common))
    got = torch.empty_like(q)  # the cache already holds this step's keys (the torch backend wrote them)
    unified_attention(q, cache, got, common.query_start_loc, common.seq_lens, common.block_table, n, n,
                      head**-0.5, num_segments=segments, config=replace(DECODE_WIDE, heads_first=heads_first))
    return {"nan": int(torch.isnan(got).sum()), "rel": float((got - ref).norm() / ref.norm())}


def _decode_big_case() -> dict[str, dict[str, float]]:
    """DECODE_BIG on decodes ending inside, at and past a 128-key tile; then a cascade batch (page 16, GQA 2:1)
    whose first 13 blocks (208 keys) are shared, told 208 (aligned to 128; CASCADE_ALIGN's 192 would split a
    128-key suffix tile and count keys 128-191 twice) or 100 (under 128: no cascade)."""
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.attention.triton.kernels import unified_attention
    from pagedllm.plugins.attention.triton.tuning import DECODE_BIG

    results: dict[str, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head, page = 4, 2, 16, 16
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5, None, None)
    contexts = [0, 14, 126, 127, 128, 255, 300]
    n = len(contexts)
    num_blocks = sum(-(-(c + 1) // page) for c in contexts) + 3
    common, _ = _batch(contexts, [1] * n, page, num_blocks, gen)
    cache = torch.randn(2, num_blocks, page, kv_heads, head, generator=gen)
    q, k, v = (torch.randn(n, h, head, generator=gen) for h in (heads, kv_heads, kv_heads))
    ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, cache, TorchSDPABackend.build_metadata(common))
    got = torch.empty_like(q)
    unified_attention(q, cache, got, common.query_start_loc, common.seq_lens, common.block_table, n, n,
                      head**-0.5, config=DECODE_BIG)
    results["plain"] = {"nan": int(torch.isnan(got).sum()), "rel": float((got - ref).norm() / ref.norm())}

    share = [1, 1, 0, 1, 1, 0]
    extra = [3, 130, 40, 1, 77, 9]
    shared = list(range(1, 14))
    block_ids, contexts, nxt = [], [], 14
    for i, e in enumerate(extra):
        ctx = 208 + e
        own = -(-(ctx + 1) // page) - (13 if share[i] else 0)
        block_ids.append((shared if share[i] else []) + list(range(nxt, nxt + own)))
        nxt += own
        contexts.append(ctx)
    n = len(contexts)
    inputs = prepare_inputs([list(range(c + 1)) for c in contexts], contexts, [1] * n, block_ids, page,
                            torch.device("cpu"), n)
    c = inputs.attn
    cache = torch.randn(2, nxt + 1, page, kv_heads, head, generator=gen)
    q, k, v = (torch.randn(n, h, head, generator=gen) for h in (heads, kv_heads, kv_heads))
    ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, cache, TorchSDPABackend.build_metadata(c))
    for told in (208, 100):
        got = torch.empty_like(q)
        cascade = torch.tensor([told, share.index(1), *share], dtype=torch.int32)
        unified_attention(q, cache, got, c.query_start_loc, c.seq_lens, c.block_table, n, n, head**-0.5,
                          cascade=cascade, config=DECODE_BIG)
        results[f"cascade_{told}"] = {"nan": int(torch.isnan(got).sum()), "rel": float((got - ref).norm() / ref.norm())}
    return results


def _main() -> None:
    """Child process: run every case under the interpreter, print one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, (contexts, queries, opts, _tol) in CASES.items():
        got, ref, cache, ref_cache = _run_both(contexts, queries, **opts)
        results[name] = {
            "nan": int(torch.isnan(got).sum()),
            "rel": float((got.float() - ref.float()).norm() / ref.float().norm()),
            "cache_equal": bool(torch.equal(cache, ref_cache)),
        }
    results["padding"] = _padding_case()
    results["decode_wide"] = _decode_wide_case()
    results["decode_wide_heads_first"] = _decode_wide_case(heads_first=True)
    results["decode_wide_heads_first_split"] = _decode_wide_case(heads_first=True, segments=3)
    results["decode_big"] = _decode_big_case()
    results["cascade"] = _cascade_case()
    from pagedllm.plugins.attention.triton import kernels as triton_kernels

    triton_kernels.MERGE_HEADS_MIN_ROWS = 0  # the large-batch merge (several heads per program) on small batches
    results["cascade_merge_heads"] = _cascade_case()
    got, ref, _, _ = _run_both([3, 30, 17], [1, 1, 1], segments=4)
    results["split_merge_heads"] = {"nan": int(torch.isnan(got).sum()), "rel": float((got - ref).norm() / ref.norm())}
    triton_kernels.MERGE_HEADS_MIN_ROWS = 4096
    results["engine"] = _engine_case()
    print(json.dumps(results))



def test_cascade_kernels_compile_for_sm90() -> None:
    """The attention kernels with and without the cascade, and the PREFILL configuration (8 warps, a deep
    pipeline: its buffers must fit one SM's 227 KB of shared memory), through Triton's sm_90 compiler offline."""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.attention.triton import kernels as t\n"
        "floats = {'scale', 'soft_cap', 'v_scale'}\n"
        "def sig_of(fn, cons, bf16):\n"
        "    def one(a):\n"
        "        if a in cons: return 'constexpr'\n"
        "        if a in bf16: return '*bf16'\n"
        "        if a.startswith('seg_') and a.endswith('_ptr'): return '*fp32'\n"
        "        if a.endswith('_ptr'): return '*i32'\n"
        "        return 'fp32' if a in floats else 'i32'\n"
        "    return {a: one(a) for a in fn.arg_names}\n"
        "def build(fn, cons, bf16, warps=4, stages=3):\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    # pointers and strides 16-divisible, as the launcher specialises them (vectorised copies)\n"
        "    attrs = {(i,): [['tt.divisibility', 16]] for i, a in enumerate(fn.arg_names)\n"
        "             if a.endswith('_ptr') or a.startswith('stride')}\n"
        "    return triton.compile(ASTSource(fn=fn, signature=sig_of(fn, cons, bf16), constexprs=keys, attrs=attrs),\n"
        "                          target=GPUTarget('cuda', 90, 32), options={'num_warps': warps, 'num_stages': stages})\n"
        "base = dict(NUM_HEADS=32, G=4, HEAD=128, HEAD_PAD=128, BLOCK_SIZE=16, USE_SOFTCAP=False, KV_FP8=False)\n"
        "plain = dict(REVERSE=False, PACK_GQA=True, K_ROWS=False)\n"
        "for split, casc in ((False, False), (False, True), (True, True)):\n"
        "    build(t._unified_attention_kernel, dict(base, BLOCK_Q=4, BLOCK_M=16, TILE_N=32, USE_WINDOW=False,\n"
        "          SPLIT=split, CASCADE=casc, DECODE_ONLY=True, HEADS_FIRST=split, **plain),\n"
        "          {'q_ptr', 'cache_ptr', 'out_ptr'})\n"
        "    build(t._reduce_segments_kernel, dict(NUM_HEADS=32, HEAD=128, HEAD_PAD=128, CASCADE=casc, CHUNK=32,\n"
        "                                          HEADS=8 if casc else 1),\n"
        "          {'out_ptr'})\n"
        "build(t._prefix_attention_kernel, dict(base, BLOCK_M=64, TILE_N=64), {'q_ptr', 'cache_ptr'})\n"
        "from pagedllm.plugins.attention.triton.tuning import PREFILL as P\n"
        "k = build(t._unified_attention_kernel, dict(base, BLOCK_Q=P.rows // 4, BLOCK_M=P.rows, TILE_N=P.tile_n,\n"
        "          USE_WINDOW=False, SPLIT=False, CASCADE=False, REVERSE=P.reverse, PACK_GQA=P.pack_gqa,\n"
        "          K_ROWS=P.k_rows), {'q_ptr', 'cache_ptr', 'out_ptr'}, P.num_warps, P.num_stages)\n"
        "assert k.metadata.shared <= 227 * 1024, k.metadata.shared\n"
        "from pagedllm.plugins.attention.triton.tuning import DECODE_BIG as B\n"
        "k = build(t._unified_attention_kernel, dict(base, BLOCK_Q=B.rows // 4, BLOCK_M=B.rows, TILE_N=B.tile_n,\n"
        "          USE_WINDOW=False, SPLIT=False, CASCADE=True, REVERSE=False, PACK_GQA=True, K_ROWS=False, ALIGN=128),\n"
        "          {'q_ptr', 'cache_ptr', 'out_ptr'}, B.num_warps, B.num_stages)\n"
        "assert k.metadata.shared <= 100 * 1024, k.metadata.shared  # 74 KB: three programs per H200 SM\n"
        "print('ok')\n"
    )
    compile_offline(code)


if __name__ == "__main__":
    _main()
