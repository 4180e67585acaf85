"""The K-major W4A16 decode GEMV (w4a16_gemv_kmajor.py) against dequantize-then-matmul, under Triton's interpreter.

Checkpoints are packed from the published GPTQ format by tests/quant_packers.py (AutoGPTQ v1 zero offset and
v2, symmetric), repacked K-major, and compared with x @ dequantize(...) in float64. Bound, elementwise, with
S = |x| @ |W^T|: |y - ref| <= 1e-5 S (+ one float16 ulp of ref for float16 outputs): the mantissa trick gives
up ~8 bits of float32 (w4a16_gemv_tiled NOTE 2). Split-K cases also check the same bits on a second run and
the tickets back at zero. A tiny GPTQ Llama through the engine with PAGEDLLM_W4A16_KMAJOR=1 gives
transformers' greedy tokens; a last test compiles the kernel for sm_90a offline (no GPU): no spills.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any

import pytest
from interpreter_child import run_interpreted
from offline_compile import PTXAS_SM90A, compile_offline

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, zeros, M, N, K, dtype, group, blocks (BLOCK_N, BLOCK_K, warps, SPLIT_K) or None)
CASES = [
    ("m1_fp32_v1_even", "v1", 1, 64, 512, "float32", 128, (4, 256, 1, 1)),
    ("m1_fp32_v2_split3_part_block", "v2", 1, 72, 768, "float32", 128, (16, 256, 1, 3)),  # 72 = 4.5 x 16
    ("m2_fp16_sym_group64_split2", "sym", 2, 40, 512, "float16", 64, (2, 128, 1, 2)),
    ("m3_fp32_v1_k_tail", "v1", 3, 24, 640, "float32", 32, (8, 256, 1, 1)),  # 640 = 2.5 steps: masked tail
    ("m4_fp16_v1_default_blocks", "v1", 4, 48, 384, "float16", 128, None),
]


def _run() -> dict[str, Any]:
    import torch
    from quant_packers import gptq_pack, quantize_rtn

    from pagedllm.layers import split_k
    from pagedllm.plugins.quantization.w4a16_gemv_kmajor import repack_kmajor, w4a16_gemv_kmajor
    from pagedllm.plugins.quantization.w4a16_layout import PackedLayout, dequantize

    results: dict[str, Any] = {}
    for i, (name, zeros, m, n, k, dtype_name, group, blocks) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(i)
        ql = quantize_rtn(torch.randn(n, k), 4, group, sym=zeros == "sym", act_order=False,
                          min_zero=1 if zeros != "v2" else 0)
        qweight, qzeros = gptq_pack(ql.q, ql.z, 4, v1=zeros != "v2")
        layout = PackedLayout("gptq", 4, group, 0 if zeros == "v2" else 1)
        scales = ql.s.to(dtype)
        x = torch.randn(m, k).to(dtype)
        ref = x.double() @ dequantize(layout, qweight, qzeros, scales, dtype=torch.float64)
        size = x.double().abs() @ dequantize(layout, qweight, qzeros, scales, dtype=torch.float64).abs()
        tensors = repack_kmajor(layout, qweight, qzeros, scales)
        y = w4a16_gemv_kmajor(x, layout, *tensors, blocks=blocks)
        again = w4a16_gemv_kmajor(x, layout, *tensors, blocks=blocks)
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-14))) - 10) if dtype == torch.float16 else 0
        tickets = split_k._TICKETS.get(x.device)
        results[name] = {
            "dtype": str(y.dtype), "shape": list(y.shape),
            "worst_over_bound": float(((y.double() - ref).abs() / (1e-5 * size + ulp)).max()),
            "same_bits_twice": bool(torch.equal(y, again)),
            "tickets_zero": tickets is None or int(tickets.abs().sum()) == 0,
        }
    return results


def _run_engine() -> dict[str, Any]:
    """A tiny GPTQ 4-bit Llama (v1, asymmetric, group 32) with PAGEDLLM_W4A16_KMAJOR=1: the greedy tokens of
    the engine (every linear through kmajor_matmul: the GEMV for decode steps, dequantize + matmul for the
    prefills) against transformers' float32 model with the dequantized weights."""
    import os
    import random
    import tempfile
    from pathlib import Path

    from quant_packers import dense_model, write_quantized_llama
    from tiny_models import hf_greedy_with, make_tiny_model

    from pagedllm import LLM, SamplingParams

    os.environ["PAGEDLLM_W4A16_KMAJOR"] = "1"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 17)]
    with tempfile.TemporaryDirectory() as root:
        src = make_tiny_model("llama", Path(root))
        folder = Path(root) / "gptq4"
        dense = write_quantized_llama(src, folder, "gptq", bits=4, group_size=32, v1=True)
        reference = dense_model(src, dense)
        expected = [hf_greedy_with(reference, p, 6)[0] for p in prompts]
        llm = LLM(str(folder), block_size=4, max_num_batched_tokens=64, num_kv_blocks=128)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        layers = [m for m in llm.engine.parts.model.modules() if "w4a16_layout" in m.__dict__]
        result = {"equal": [list(o.outputs[0].token_ids) for o in outs] == [list(e) for e in expected],
                  "layers": len(layers), "kmajor": sum(bool(m.__dict__.get("w4a16_kmajor")) for m in layers)}
        llm.shutdown()
    return result


@functools.cache
def _results() -> dict[str, Any]:
    return dict(run_interpreted(__file__))


def test_engine_greedy_with_kmajor_layers_matches_transformers() -> None:
    got = run_interpreted(__file__, "engine", timeout=600)
    assert got["layers"] > 0 and got["kmajor"] == got["layers"], got
    assert got["equal"], got


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kmajor_equals_dequantize_then_matmul(case: tuple[Any, ...]) -> None:
    name, m, n, dtype = case[0], case[2], case[3], case[5]
    got = _results()[name]
    assert got["shape"] == [m, n] and got["dtype"] == f"torch.{dtype}"
    assert got["worst_over_bound"] <= 1.0, got
    assert got["same_bits_twice"] and got["tickets_zero"], got


def test_repack_refuses_what_the_kernel_cannot_read() -> None:
    import torch

    from pagedllm.plugins.quantization.w4a16_gemv_kmajor import repack_kmajor
    from pagedllm.plugins.quantization.w4a16_layout import PackedLayout

    q = torch.zeros(8, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="GPTQ 4-bit"):
        repack_kmajor(PackedLayout("gptq", 8, 128, 1), q, q, torch.zeros(1, 16))
    with pytest.raises(ValueError, match="multiple of 32"):
        repack_kmajor(PackedLayout("gptq", 4, 16, 1), q, q, torch.zeros(1, 16))


def test_compiles_for_sm90a_without_spills() -> None:
    """The kernel at the 8B shapes' launch (4 warps, BLOCK_K 4096, M = 1 and 4), through Triton and ptxas for
    sm_90a (offline): no spills; the register counts are printed."""
    code = PTXAS_SM90A + (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization import w4a16_gemv_kmajor as t\n"
        "fn = t._w4a16_gemv_kmajor_kernel\n"
        "for rows, bn, fused in ((1, 4, False), (4, 2, True)):\n"
        "    cons = dict(GROUP_SIZE=128, ROWS=rows, BLOCK_N=bn, BLOCK_K=4096, EVEN=True, FUSED_SPLIT=fused)\n"
        "    ptrs = {'x_ptr': '*bf16', 's_ptr': '*bf16', 'z_ptr': '*bf16', 'y_ptr': '*bf16', 'part_ptr': '*fp32'}\n"
        "    sig = {a: 'constexpr' if a in cons else ptrs.get(a, '*i32') if a.endswith('_ptr') else 'i32'\n"
        "           for a in fn.arg_names}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys),\n"
        "                            target=GPUTarget('cuda', 90, 32), options={'num_warps': 4})\n"
        "    print(rows, ptxas_sm90a(kernel))\n"
        "print('ok')\n"
    )
    print(compile_offline(code))


if __name__ == "__main__":
    import json

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    print(json.dumps(_run_engine() if sys.argv[1:] == ["engine"] else _run()))
