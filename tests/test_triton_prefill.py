"""The fresh-prefill kernel (plugins/attention/triton/prefill.py) and the triton backend's route to it.

Kernel cases run under Triton's interpreter in one child process (this file as a script; see
test_triton_attention.py for why the interpreter needs its own process) and are compared with torch's
scaled_dot_product_attention in float32 per request. The routing rule (which requests are fresh) is host code
and runs here. The sm_90 compile of the TMA and warp-specialized variants runs offline (no GPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from typing import Any

import pytest
import torch
from interpreter_child import run_interpreted
from offline_compile import PTXAS_SM90A, compile_offline

from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.worker.input_prep import prepare_inputs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# name -> (query lengths of the fresh run, options). The run is preceded by 9 rows of another request that the
# kernel must leave alone. Tolerance on ||got - ref|| / ||ref||: 1e-5 in float32, 5e-3 in float16.
KERNEL_CASES: dict[str, tuple[list[int], dict[str, Any]]] = {
    "gqa2_host_fp32": ([40, 7, 33], {}),
    "gqa2_host_fp16": ([40, 7, 33], {"dtype": "float16"}),
    "gqa4_device_per_head": ([37, 20], {"heads": 8, "kv_heads": 2, "kv_load": "device", "pack_gqa": False}),
    "pointer_loads": ([40, 7, 33], {"kv_load": "pointer"}),
    "warp_spec_path": ([40, 7, 33], {"warp_specialize": True}),  # one masked loop, Q through a descriptor
    "window": ([45, 12], {"window": 6}),
    "window_warp_spec_fp16": ([45, 12], {"window": 6, "warp_specialize": True, "dtype": "float16"}),
    "soft_cap": ([30, 19], {"soft_cap": 1.5}),
    "mqa_head64_tile32": ([50], {"heads": 4, "kv_heads": 1, "head": 64, "rows": 32, "tile_n": 32}),
    # K/V rows strided inside a fused qkv row (as the model passes them) but a Q the pointer path must take
    "unaligned_rows_fall_back": ([40, 7], {"qkv_pad": 3}),
}


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_against_sdpa(interp: dict[str, Any], case: str) -> None:
    res = interp["kernel"][case]
    tol = 5e-3 if KERNEL_CASES[case][1].get("dtype") == "float16" else 1e-5
    assert res["nan"] == 0 and res["others_untouched"], res
    assert res["rel"] < tol, res


def test_backend_mixed_step_matches_torch(interp: dict[str, Any]) -> None:
    """Decodes, a later chunk and fresh prompts in one step: the fresh run through the new kernel, the rest
    through the unified one, equal to the torch backend; and the same step with the route switched off."""
    res = interp["backend"]
    assert res["fresh_from"] == 3 and res["off_from"] is None, res  # requests 3 and 4 are the fresh run
    assert res["rel_fresh"] < 1e-5 and res["rel_off"] < 1e-5 and res["cache_equal"], res


def test_engine_greedy_tokens_match_torch(interp: dict[str, Any]) -> None:
    assert interp["engine"] == {"backends": ["torch", "triton"], "equal": True, "routed": True}


def _common(contexts: list[int], queries: list[int], block_size: int = 16) -> Any:
    blocks, nxt = [], 1
    for c, q in zip(contexts, queries, strict=True):
        n = -(-(c + q) // block_size)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    decodes = 0
    while decodes < len(queries) and queries[decodes] == 1:
        decodes += 1
    return prepare_inputs([list(range(c + q)) for c, q in zip(contexts, queries, strict=True)], contexts, queries,
                          blocks, block_size, torch.device("cpu"), decodes).attn


@pytest.mark.parametrize(("contexts", "queries", "start"), [
    ([5, 9], [1, 1], None),  # decode-only: nothing to route
    ([0, 0], [100, 70], 0),  # every request fresh
    ([5, 9, 0, 0], [1, 1, 100, 30], 2),  # decodes, then fresh prompts (the short one rides along)
    ([0, 20, 0], [100, 80, 90], 2),  # a later chunk (20 cached) in the middle: only the run after it
    ([0, 0], [30, 40], None),  # fresh, but the run's longest is under FRESH_MIN_QUERY_LEN
    ([0, 16], [100, 70], None),  # the last request had a prefix-cache hit: no run ends the batch
    ([0, 0, 0], [16, 16, 16], None),  # a uniform step like a CUDA-graph capture's dummy: never routed
])
def test_fresh_run_start(contexts: list[int], queries: list[int], start: int | None) -> None:
    from pagedllm.plugins.attention.triton.backend import fresh_run_start

    assert fresh_run_start(_common(contexts, queries)) == start


def test_fresh_route_default_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend routes only runs whose longest request has `fresh_prefill_min_tokens` new tokens (1024 by
    default: W1's 1024-token prompts gained on the H200, perf-notes §18a); the option cannot go below 64."""
    from pagedllm.plugins.attention import triton as plugin
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    assert TritonBackend.options.fresh_prefill_min_tokens == 1024
    assert TritonBackend.build_metadata(_common([5, 0, 0], [1, 1023, 900])).fresh_from is None
    assert TritonBackend.build_metadata(_common([5, 0, 0], [1, 1024, 900])).fresh_from == 1
    low = TritonBackend.configure(plugin.TritonOptions(fresh_prefill_min_tokens=64))
    assert low.build_metadata(_common([5, 0, 0], [1, 1000, 900])).fresh_from == 1
    with pytest.raises(Exception, match="fresh_prefill_min_tokens"):
        plugin.TritonOptions.model_validate({"fresh_prefill_min_tokens": 32})


def test_fresh_route_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plugins.triton.fresh_prefill: false` (validated, bound to the engine's backend by `configure`) keeps every
    request on the unified kernel."""
    from pagedllm.config import EngineConfig, validate_plugin_sections
    from pagedllm.plugins.attention import triton as plugin
    from pagedllm.plugins.attention.triton.backend import TritonBackend
    from pagedllm.plugins.attention.triton.tuning import FRESH_MIN_QUERY_LEN

    assert TritonBackend.cuda_graph_max_query_len < FRESH_MIN_QUERY_LEN
    config = EngineConfig.from_dict({"plugins": {"triton": {"fresh_prefill": False}}}, env={})
    sections = validate_plugin_sections(config, {"triton": plugin.TritonOptions})
    off = TritonBackend.configure(sections["triton"])
    assert off.build_metadata(_common([0], [100])).fresh_from is None
    with pytest.raises(Exception, match="fresh_prefil"):
        plugin.TritonOptions.model_validate({"fresh_prefil": True})


def test_plan_blocks_longest_first() -> None:
    import numpy as np

    from pagedllm.plugins.attention.triton.prefill import plan_blocks

    plan = plan_blocks(np.array([9, 49, 56], dtype=np.int32), 16)  # requests of 40 and 7 rows from row 9
    rows = sorted(map(tuple, plan.tolist()))
    assert rows == [(9, 40, 0), (9, 40, 16), (9, 40, 32), (49, 7, 0)]
    keys = [min(first + 16, n) for _, n, first in plan.tolist()]
    assert keys == sorted(keys, reverse=True)


def test_fresh_kernel_compiles_for_sm90() -> None:
    """The default configuration (host descriptors) and the warp-specialized one through Triton's sm_90
    compiler offline: the Hopper pass must split the loop (ttg.warp_specialize in the TTGIR, 12 warps), the
    buffers fit one SM's 227 KB, and ptxas (where triton ships one for sm_90a) reports no spills."""
    code = PTXAS_SM90A + (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.attention.triton import prefill as tp\n"
        "from pagedllm.plugins.attention.triton.tuning import FRESH_PREFILL, FreshPrefillConfig\n"
        "fn = tp._fresh_prefill_kernel\n"
        "def build(cfg, head=128):\n"
        "    block_m, block_q, tile, pack = tp.launch_shape(cfg, 4)\n"
        "    tma = cfg.kv_load != 'pointer'\n"
        "    cons = dict(NUM_HEADS=32, KV_HEADS=8, G=4, HEAD=head, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile,\n"
        "                USE_WINDOW=False, USE_SOFTCAP=False, PACK_GQA=pack, TMA=tma,\n"
        "                DEVICE_DESC=cfg.kv_load == 'device', WARP_SPEC=cfg.warp_specialize and tma)\n"
        "    host = cfg.kv_load == 'host'\n"
        "    def ty(a):\n"
        "        if a in cons: return 'constexpr'\n"
        "        if a == 'q_src' and host and not pack: return f'tensordesc<bf16[{block_m},{head}]>'\n"
        "        if a in ('k_src', 'v_src') and host: return f'tensordesc<bf16[{tile},{head}]>'\n"
        "        if a in ('q_src', 'k_src', 'v_src', 'out_ptr'): return '*bf16'\n"
        "        if a == 'plan_ptr': return '*i32'\n"
        "        return 'fp32' if a in ('scale', 'soft_cap') else 'i32'\n"
        "    sig = {a: ty(a) for a in fn.arg_names}\n"
        "    attrs = {(i,): [['tt.divisibility', 16]] for i, a in enumerate(fn.arg_names)\n"
        "             if sig[a].startswith('*') or a.startswith('stride')}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys, attrs=attrs),\n"
        "                       target=GPUTarget('cuda', 90, 32),\n"
        "                       options={'num_warps': cfg.num_warps, 'num_stages': cfg.num_stages})\n"
        "    assert k.metadata.shared <= 227 * 1024, k.metadata.shared\n"
        "    return k\n"
        "k = build(FRESH_PREFILL)\n"
        "print('default', k.metadata.num_warps, ptxas_sm90a(k))\n"
        "ws = FreshPrefillConfig(rows=128, tile_n=64, num_warps=4, num_stages=3, kv_load='device',\n"
        "                        warp_specialize=True)\n"
        "k = build(ws)\n"
        "assert 'ttg.warp_specialize' in k.asm['ttgir'] and k.metadata.num_warps == 12, k.metadata.num_warps\n"
        "print('warp-specialized', k.metadata.num_warps, ptxas_sm90a(k))\n"
        "k = build(ws, head=64)\n"
        "assert 'ttg.warp_specialize' in k.asm['ttgir']\n"
        "print('ok')\n"
    )
    print(compile_offline(code))


# -- the interpreter child -------------------------------------------------------------------------------------


def _sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], window: int | None,
                    soft_cap: float | None) -> torch.Tensor:
    """Per request: causal attention in float32 (torch SDPA; with a soft-cap, the capped scores' softmax)."""
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lens:
        qq = q[start:start + n].float().transpose(0, 1)
        kk, vv = (x[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        if soft_cap is None:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
        else:
            scores = soft_cap * torch.tanh(qq @ kk.transpose(1, 2) / math.sqrt(q.shape[2]) / soft_cap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


def _kernel_case(lens: list[int], heads: int = 4, kv_heads: int = 2, head: int = 16, dtype: str = "float32",
                 window: int | None = None, soft_cap: float | None = None, qkv_pad: int = 0,
                 **config: Any) -> dict[str, Any]:
    from dataclasses import replace

    import numpy as np

    from pagedllm.plugins.attention.triton.prefill import fresh_prefill_attention, launch_shape
    from pagedllm.plugins.attention.triton.prefill import plan_blocks as plan_of
    from pagedllm.plugins.attention.triton.tuning import FreshPrefillConfig

    gen = torch.Generator().manual_seed(len(lens) * 7 + head)
    dt = getattr(torch, dtype)
    before = 9  # rows of a request outside the run
    total = before + sum(lens)
    # q, k and v as views of one fused row, as the model's qkv projection leaves them (pad: misaligned rows)
    width = (heads + 2 * kv_heads) * head + qkv_pad
    qkv = torch.randn(total + 2, width, generator=gen).to(dt)  # + 2 padding rows
    q = qkv[:, : heads * head].view(-1, heads, head)
    k = qkv[:, heads * head : (heads + kv_heads) * head].view(-1, kv_heads, head)
    v = qkv[:, (heads + kv_heads) * head : (heads + 2 * kv_heads) * head].view(-1, kv_heads, head)
    cfg = replace(FreshPrefillConfig(rows=16, tile_n=16, num_warps=4, num_stages=2), **config)
    starts = np.cumsum([before, *lens]).astype(np.int32)
    plan = torch.from_numpy(plan_of(starts, launch_shape(cfg, heads // kv_heads)[1]))
    out = torch.zeros(total + 2, heads, head, dtype=dt)
    fresh_prefill_attention(q, k, v, out, plan, total, head**-0.5, window, soft_cap, cfg)
    ref = _sdpa_reference(q[before:total], k[before:total], v[before:total], lens, window, soft_cap)
    got = out[before:total].float()
    return {"nan": int(torch.isnan(got).sum()), "rel": float((got - ref).norm() / ref.norm()),
            "others_untouched": bool((out[:before] == 0).all() and (out[total:] == 0).all())}


def _backend_case() -> dict[str, Any]:
    """One step: 2 decodes, a later chunk (12 cached), then 2 fresh prompts (70 and 21 tokens)."""
    from pagedllm.plugins.attention import triton as plugin
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    contexts, queries = [30, 17, 12, 0, 0], [1, 1, 25, 70, 21]
    heads, kv_heads, head, bs = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(5)
    common = _common(contexts, queries, bs)
    num_blocks = int(common.block_table.max()) + 2
    cache = torch.randn(2, num_blocks, bs, kv_heads, head, generator=gen)
    tokens = sum(queries)
    q = torch.randn(tokens, heads, head, generator=gen)
    kv = torch.randn(tokens, 2, kv_heads, head, generator=gen)
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5)
    ref_cache = cache.clone()
    ref = TorchSDPABackend.make_impl(layer).forward(q, kv[:, 0], kv[:, 1], ref_cache,
                                                    TorchSDPABackend.build_metadata(common))
    low = TritonBackend.configure(plugin.TritonOptions(fresh_prefill_min_tokens=64))  # 1024 is for real sizes
    md = low.build_metadata(common)
    got_cache = cache.clone()
    got = low.make_impl(layer).forward(q, kv[:, 0], kv[:, 1], got_cache, md)
    off_backend = TritonBackend.configure(plugin.TritonOptions(fresh_prefill=False))
    md_off = off_backend.build_metadata(common)
    off = off_backend.make_impl(layer).forward(q, kv[:, 0], kv[:, 1], cache.clone(), md_off)
    return {"fresh_from": md.fresh_from, "off_from": md_off.fresh_from,
            "rel_fresh": float((got - ref).norm() / ref.norm()), "rel_off": float((off - ref).norm() / ref.norm()),
            "cache_equal": bool(torch.equal(got_cache, ref_cache))}


def _engine_case() -> dict[str, Any]:
    """Greedy tokens of a tiny Qwen3-shaped model (GQA, head 32), triton vs torch, with prompts long enough for
    the fresh route: a 128-token budget puts a 70-token prompt and the first 58 of a 90-token one in step 1."""
    import tempfile
    from pathlib import Path

    from pagedllm import LLM, SamplingParams
    from pagedllm.plugins.attention.triton import backend as triton_backend

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import make_tiny_model

    routed = []
    build = triton_backend.TritonBackend.build_metadata.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, common: Any) -> Any:  # the engine's configured subclass comes in as cls
        md = build(cls, common)
        routed.append(md.fresh_from is not None)
        return md

    triton_backend.TritonBackend.build_metadata = classmethod(spy)  # type: ignore[method-assign, assignment]
    with tempfile.TemporaryDirectory() as root:
        path = make_tiny_model("qwen3", Path(root))
        prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 300 for j in range(n)]} for i, n in enumerate((70, 90))]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)
        tokens, logprobs = {}, {}
        for backend in ("torch", "triton"):
            llm = LLM(path, attention={"backend": backend}, device="cpu", dtype="float32",
                      max_num_seqs=2, max_num_batched_tokens=128, block_size=16,
                      plugins={"triton": {"fresh_prefill_min_tokens": 64}})
            chosen = llm.engine.parts.selections["attention"].winner.name
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[chosen] = [list(o.outputs[0].token_ids) for o in outs]
            # the sampled tokens' logprobs: greedy tokens alone barely move when attention is slightly off
            logprobs[chosen] = [p[t].logprob for o in outs for t, p in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            llm.shutdown()
    gap = max(abs(a - b) for a, b in zip(logprobs["torch"], logprobs["triton"], strict=True))
    return {"backends": sorted(tokens), "equal": tokens.get("torch") == tokens.get("triton") and gap < 1e-4,
            "routed": any(routed)}


def _main() -> None:
    """Child process: every case under the interpreter, one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    results: dict[str, Any] = {"kernel": {}}
    for name, (lens, opts) in KERNEL_CASES.items():
        results["kernel"][name] = _kernel_case(lens, **opts)
    results["backend"] = _backend_case()
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind

    pm = get_plugin_manager()
    if pm.get(PluginKind.ATTENTION, "triton") is None:
        import pagedllm.plugins.attention.triton as plugin

        pm.register(plugin, "triton-in-tree")
    results["engine"] = _engine_case()
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
