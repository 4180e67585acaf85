"""layers/qk_norm.qk_norm_rope: Qwen3's and Gemma 3's per-head q/k RMSNorm then RoPE, against transformers.

The references are transformers' Qwen3RMSNorm / Gemma3RMSNorm applied per head and its apply_rotary_pos_emb.
On the CPU (the torch code) the result must be those bit for bit in float32, float16 and bfloat16. The fused
kernel (qk_norm_kernel.py) runs under Triton's interpreter in ONE child process (this file as a script,
TRITON_INTERPRET=1 set before triton is imported), fp32 and fp16 only (the interpreter's bf16 math is not the
GPU's; examples/gpu/qk_norm_check.py checks bf16 on the H200). Its shapes: GQA 32 q / 8 kv heads, head dims
64 / 128 / 256 (and 80: a head that is not a power of two), 1 token and row counts that leave a partial tile.
The greedy tokens of a tiny Qwen3 with every fused op on are test_fused_ops.py's engine check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest
import torch

from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.qk_norm import qk_norm_rope
from pagedllm.layers.rotary import RotaryEmbedding

# name -> (tokens, q heads, kv heads, head dim, rotary dim); rows = tokens * (q + kv heads)
CASES = {
    "t1_gqa_h128": (1, 32, 8, 128, 128),
    "t7_gqa_h64": (7, 32, 8, 64, 64),
    "t3_gqa_h256": (3, 32, 8, 256, 256),
    "t5_h80_odd_rows": (5, 3, 1, 80, 80),  # 20 rows: one full tile of 16 and a partial one
    "t3_partial_rotary": (3, 4, 2, 64, 32),  # rotary_dim < head: the norm fuses, RoPE runs on its own
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KERNEL_DTYPES = ("float32", "float16")
# Max |got - ref| / max |ref|: fp32 to its rounding (sums in another order); fp16 one or two half ulps.
TOL = {"float32": 2e-6, "float16": 1e-3}
# Share of the normalised (not yet rotated) fp16 elements allowed to differ from transformers' norm at all:
# the kernel rounds where the layers round (qk_norm_kernel.py NOTE 2), so only a sum of squares in another
# order moves a rounding; one rounding too many or too few moves ~20 % of them. (The rotation is compared
# with a tolerance only: like rotary_embedding it rotates in float32 and rounds once where transformers
# rounds cos, sin and each product.)
MAX_DIFFER = 0.02
EPS = 1e-6


def _inputs(case: str, dtype: torch.dtype, gemma: bool, seed: int) -> dict[str, Any]:
    """A qkv row buffer with q and k as its strided views, the two norms and the RoPE of one case."""
    tokens, heads, kv_heads, head, rot = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    norm_cls = GemmaRMSNorm if gemma else RMSNorm
    q_norm, k_norm = norm_cls(head, EPS, dtype), norm_cls(head, EPS, dtype)
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(torch.randn(head, generator=gen) * 0.5 + (0.0 if gemma else 1.0))
    rope = RotaryEmbedding(head, rot, 4096, 1e6)
    q_size, kv_size = heads * head, kv_heads * head
    qkv = (torch.randn(tokens, q_size + 2 * kv_size, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    return {"qkv": qkv, "q_size": q_size, "kv_size": kv_size, "head": head, "rot": rot, "positions": positions,
            "q_norm": q_norm, "k_norm": k_norm, "rope": rope}


def _run(inp: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    q_size, kv_size = inp["q_size"], inp["kv_size"]
    q, k = inp["qkv"][:, :q_size], inp["qkv"][:, q_size : q_size + kv_size]
    return qk_norm_rope(inp["positions"], q, k, inp["q_norm"], inp["k_norm"], inp["rope"], inp["head"])


def _reference(inp: dict[str, Any], gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers: the norm on each [head] row, then rotate_half RoPE on the first rotary_dim dims (none: 0)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    qkv, q_size, kv_size, head, rot = inp["qkv"], inp["q_size"], inp["kv_size"], inp["head"], inp["rot"]
    tokens, dtype = qkv.shape[0], qkv.dtype
    outs = []
    for view, module in ((qkv[:, :q_size], inp["q_norm"]), (qkv[:, q_size : q_size + kv_size], inp["k_norm"])):
        ref_norm = Gemma3RMSNorm(head, eps=EPS) if gemma else Qwen3RMSNorm(head, eps=EPS)
        with torch.no_grad():
            ref_norm.weight.copy_(module.weight.float())
            ref_norm.to(dtype)
            x = ref_norm(view.reshape(tokens, -1, head))  # [T, heads, head]
        if not rot:  # the norms alone
            outs.append(x.reshape(tokens, -1))
            continue
        cos = inp["rope"].cos_cache[inp["positions"]]
        sin = inp["rope"].sin_cache[inp["positions"]]
        # transformers' [T, rot] tables (the half repeated), in the model dtype, broadcast over the heads.
        full_cos = torch.cat((cos, cos), -1).to(dtype)
        full_sin = torch.cat((sin, sin), -1).to(dtype)
        rotated, _ = apply_rotary_pos_emb(x[..., :rot], x[..., :rot], full_cos, full_sin, unsqueeze_dim=1)
        outs.append(torch.cat((rotated, x[..., rot:]), -1).reshape(tokens, -1))
    return outs[0], outs[1]


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_path_is_transformers_bit_for_bit(case: str, dtype: str, gemma: bool) -> None:
    inp = _inputs(case, DTYPES[dtype], gemma, seed=1)
    ref_q, ref_k = _reference(inp, gemma)
    got_q, got_k = _run(inp)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


# -------------------------------------------------------------------------------------- kernel, interpreted
@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from interpreter_child import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_transformers(interp: dict[str, Any], case: str, dtype: str, gemma: bool) -> None:
    res = interp[f"{case}_{dtype}_{'gemma3' if gemma else 'qwen3'}"]
    assert res["q_err"] < TOL[dtype] and res["k_err"] < TOL[dtype] and res["norm_err"] < TOL[dtype], res
    if dtype == "float16":
        assert res["norm_differ"] < MAX_DIFFER, res
    assert res["v_untouched"], "the v part of the qkv buffer must not change"
    assert res["in_place"], "q and k are written in place into the qkv buffer and returned"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_layers_kernels(interp: dict[str, Any], case: str, dtype: str) -> None:
    """One launch gives what rms_norm (twice) and rotary_embedding gave, bit for bit here; full-width neox RoPE
    rides in that launch, a partial one stays the rotary kernel's."""
    res = interp[f"{case}_{dtype}_qwen3"]
    assert res["equal_to_layers"], res
    rot_fused = CASES[case][4] == CASES[case][3]
    assert res["launches"] == {"qk_norm": 1, "rms_norm": 0, "rotary": 0 if rot_fused else 1}, res


def test_mixed_dtypes_and_shapes_take_the_layers(interp: dict[str, Any]) -> None:
    """Norms of two forms or dtypes, or q as [T, heads, head], are the layers' business (they cast and reshape):
    the kernel takes only what it computes exactly."""
    assert interp["guards"] == {"same": True, "fp32_k_norm": False, "gemma_k_norm": False, "3d_q": False}


def test_kernel_compiles_for_sm90() -> None:
    """The bf16 kernel, with and without RoPE, in both forms, through Triton's compiler for the H200 (offline)."""
    from offline_compile import compile_offline

    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.layers.qk_norm_kernel import _qk_norm_kernel as fn\n"
        "types = {'pos_ptr': '*i64', 'cos_ptr': '*fp32', 'sin_ptr': '*fp32', 'eps': 'fp32'}\n"
        "for rope in (False, True):\n"
        "    for gemma in (False, True):\n"
        "        c = dict(NUM_Q=32, NUM_K=8, HEAD=128, BLOCK=128, HALF_BLOCK=64, ROWS=16, GEMMA=gemma, ROPE=rope)\n"
        "        sig = {a: 'constexpr' if a in c else types.get(a, '*bf16' if a.endswith('_ptr') else 'i32')\n"
        "               for a in fn.arg_names}\n"
        "        keys = {(fn.arg_names.index(k),): v for k, v in c.items()}\n"
        "        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys),\n"
        "                       target=GPUTarget('cuda', 90, 32), options={'num_warps': 4})\n"
        "print('ok')\n"
    )
    compile_offline(code)


def _guards() -> dict[str, bool]:
    from pagedllm.layers.fused_ops import set_fused_ops
    from pagedllm.layers.qk_norm import _fusable

    inp = _inputs("t1_gqa_h128", torch.float16, False, seed=2)
    q_size, kv_size, head = inp["q_size"], inp["kv_size"], inp["head"]
    q, k = inp["qkv"][:, :q_size], inp["qkv"][:, q_size : q_size + kv_size]
    q_norm, k_norm = inp["q_norm"], inp["k_norm"]
    for norm in (q_norm, k_norm):
        set_fused_ops(norm, "always")
    return {
        "same": _fusable(q, k, q_norm, k_norm),
        "fp32_k_norm": _fusable(q, k, q_norm, RMSNorm(head, EPS, torch.float32)),
        "gemma_k_norm": _fusable(q, k, q_norm, GemmaRMSNorm(head, EPS, torch.float16)),
        "3d_q": _fusable(q.reshape(1, -1, head), k, q_norm, k_norm),
    }


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _child_case(case: str, dtype: torch.dtype, gemma: bool) -> dict[str, Any]:
    from pagedllm.layers import qk_norm_kernel, triton_ops
    from pagedllm.layers.fused_ops import set_fused_ops

    launches = {"qk_norm": 0, "rms_norm": 0, "rotary": 0}
    originals = {"qk_norm": (qk_norm_kernel, "qk_norm_in_place"), "rms_norm": (triton_ops, "rms_norm"),
                 "rotary": (triton_ops, "rotary_embedding")}
    saved = {name: getattr(mod, attr) for name, (mod, attr) in originals.items()}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            launches[name] += 1
            return saved[name](*args, **kwargs)
        return call

    inp = _inputs(case, dtype, gemma, seed=3)
    before = inp["qkv"].clone()
    ref_q, ref_k = _reference(inp, gemma)
    for module in (inp["q_norm"], inp["k_norm"], inp["rope"]):
        set_fused_ops(module, "always")
    # The layers one after another, each on its own kernel (a copy of the buffer).
    layers = dict(inp, qkv=before.clone())
    tokens, q_size, kv_size, head = before.shape[0], inp["q_size"], inp["kv_size"], inp["head"]
    lq = inp["q_norm"](layers["qkv"][:, :q_size].reshape(tokens, -1, head)).reshape(tokens, q_size)
    lk = inp["k_norm"](layers["qkv"][:, q_size : q_size + kv_size].reshape(tokens, -1, head)).reshape(tokens, kv_size)
    lq, lk = inp["rope"](inp["positions"], lq.contiguous(), lk.contiguous())
    for name, (mod, attr) in originals.items():
        setattr(mod, attr, counting(name))
    try:
        got_q, got_k = _run(inp)
    finally:
        for name, (mod, attr) in originals.items():
            setattr(mod, attr, saved[name])
    qkv = inp["qkv"]
    # The norms alone (no RoPE in the launch) against transformers' norms alone.
    plain = before.clone()
    nq, nk = plain[:, :q_size], plain[:, q_size : q_size + kv_size]
    saved["qk_norm"](nq, nk, inp["q_norm"].weight, inp["k_norm"].weight, EPS, head, gemma)
    ref_nq, ref_nk = _reference(dict(inp, qkv=before.clone(), rot=0), gemma)
    norm_differ = float(torch.cat(((nq != ref_nq).flatten(), (nk != ref_nk).flatten())).float().mean())
    return {
        "q_err": _err(got_q, ref_q), "k_err": _err(got_k, ref_k), "norm_differ": norm_differ,
        "norm_err": max(_err(nq, ref_nq), _err(nk, ref_nk)),
        "v_untouched": bool(torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])),
        "in_place": got_q.data_ptr() == qkv.data_ptr() and bool(torch.equal(qkv[:, :q_size], got_q))
        and bool(torch.equal(qkv[:, q_size : q_size + kv_size], got_k)),
        "equal_to_layers": bool(torch.equal(got_q, lq) and torch.equal(got_k, lk)),
        "launches": launches,
    }


def _main() -> None:
    """Child process: every kernel case under the interpreter, one JSON line on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    torch.set_num_threads(1)
    results: dict[str, Any] = {"guards": _guards()}
    for case in CASES:
        for dname in KERNEL_DTYPES:
            for gemma in (False, True):
                key = f"{case}_{dname}_{'gemma3' if gemma else 'qwen3'}"
                results[key] = _child_case(case, DTYPES[dname], gemma)
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
