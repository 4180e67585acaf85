"""The tiled decode GEMV variants (w4a16/gemv_tiled.py) against dequantize-then-matmul, under Triton's interpreter.

As in test_quant_w4a16_gemv.py: cases run in child processes (this file as a script; TRITON_INTERPRET is set
before triton is imported) and the tests read their JSON. Bound, elementwise, with S = |x| @ |W^T|:
    float32 activations   |y - ref| <= c * S                  c = 1e-6 (tile*), 1e-5 (mant*: NOTE 2's
                                                               subtraction gives up to 8 bits of float32)
    float16 activations   |y - ref| <= ulp16(ref) + c * S     plus the one rounding of y to float16
    bfloat16 activations  |y - ref| <= ulp(ref) + c * S       the interpreter's bf16 math is unreliable, but
                                                               these kernels widen x with integer ops (NOTE 4)
Split-K cases also check the in-kernel sum (NOTE 3): the same bits on a second run, tickets back to zero.
A last test compiles every variant for sm_90 (no GPU needed): the interpreter does not run Triton's compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from typing import Any

import pytest
from interpreter_child import run_interpreted
from offline_compile import compile_offline

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

VARIANTS = ("tile", "tile_pf", "mant", "mant_pf")
# (name, variant, kind, bits, zeros, M, N, K, dtype, blocks (BLOCK_N, BLOCK_K, warps, SPLIT_K) or None)
CASES = [
    *[(f"{v}_gptq_m1_fp32_split3", v, "gptq", 4, "v1", 1, 200, 768, "float32", (128, 64, 1, 3)) for v in VARIANTS],
    *[(f"{v}_awq_m3_fp16_split2", v, "awq", 4, "v2", 3, 136, 512, "float16", (64, 32, 2, 2)) for v in VARIANTS],
    *[(f"{v}_gptq_m2_fp16_direct", v, "gptq", 4, "sym", 2, 200, 256, "float16", (256, 128, 2, 1))
      for v in VARIANTS],
    *[(f"{v}_gptq_m2_bf16_split2", v, "gptq", 4, "v1", 2, 136, 512, "bfloat16", (128, 64, 1, 2))
      for v in ("tile", "mant")],
    ("tile_pf_gptq_m4_fp32_default", "tile_pf", "gptq", 4, "v1", 4, 200, 512, "float32", None),
    ("mant_gptq_m1_fp32_default", "mant", "gptq", 4, "v2", 1, 200, 512, "float32", None),
    # more splits than sum_split_partials' chunk (16 at one row, 4 at four): two chunks, the second part-masked
    ("mant_gptq_m1_fp32_split24", "mant", "gptq", 4, "v1", 1, 200, 768, "float32", (128, 32, 1, 24)),
    ("tile_gptq_m4_fp16_split6", "tile", "gptq", 4, "v1", 4, 136, 768, "float16", (64, 128, 1, 6)),
    ("tile_gptq8_m1_fp32_split2", "tile", "gptq", 8, "v1", 1, 120, 256, "float32", (128, 32, 1, 2)),
    ("mant_gptq8_falls_back", "mant", "gptq", 8, "v1", 1, 120, 256, "float32", None),
    ("tile_m6_falls_back", "tile", "gptq", 4, "v1", 6, 120, 256, "float16", None),
]
CHUNKS = 6


def _run(chunk: int) -> dict[str, Any]:
    import torch
    from quant_packers import awq_pack, gptq_pack, quantize_rtn

    from pagedllm.layers import split_k
    from pagedllm.plugins.quantization.w4a16 import gemv_tiled as tiled
    from pagedllm.plugins.quantization.w4a16.gemv import w4a16_gemv
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout, awq_to_gptq, dequantize

    results: dict[str, Any] = {}
    for i, (name, variant, kind, bits, zeros, m, n, k, dtype_name, blocks) in enumerate(CASES):
        if i % CHUNKS != chunk:
            continue
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(i)
        group = 128
        ql = quantize_rtn(torch.randn(n, k), bits, group, sym=zeros == "sym", act_order=False,
                          min_zero=1 if zeros != "v2" else 0)
        if kind == "awq":
            qweight, qzeros = awq_pack(ql.q, ql.z)
            layout = PackedLayout("awq", 4, group)
        else:
            qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=zeros != "v2")
            layout = PackedLayout("gptq", bits, group, 0 if zeros == "v2" else 1)
        scales = ql.s.to(dtype)
        x = torch.randn(m, k).to(dtype)
        w_t = dequantize(layout, qweight, qzeros, scales, dtype=torch.float64)
        if kind == "awq":
            layout, qweight, qzeros = awq_to_gptq(layout, qweight, qzeros, rows_per_chunk=64)
        y = w4a16_gemv(x, layout, qweight, qzeros, scales, n, blocks=blocks, variant=variant)
        again = w4a16_gemv(x, layout, qweight, qzeros, scales, n, blocks=blocks, variant=variant)
        ref = x.double() @ w_t
        size = x.double().abs() @ w_t.abs()
        err = (y.double() - ref).abs()
        bits = {torch.float16: 10, torch.bfloat16: 7}.get(dtype)
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-14))) - bits) if bits else 0.0
        c = 1e-5 if variant.startswith("mant") else 1e-6
        bound = c * size + ulp
        tickets = split_k._TICKETS.get(x.device)
        results[name] = {
            "dtype": str(y.dtype), "shape": list(y.shape),
            "tiled": tiled.tiled_reason(variant, layout, m) is None,
            "worst_over_bound": float((err / bound).max()),
            "same_bits_twice": bool(torch.equal(y, again)),
            "tickets_zero": tickets is None or int(tickets.abs().sum()) == 0,
        }
    return results


@functools.cache
def _chunk_results(chunk: int) -> dict[str, Any]:
    return dict(run_interpreted(__file__, str(chunk)))


def _result(name: str) -> dict[str, Any]:
    index = [c[0] for c in CASES].index(name)
    return dict(_chunk_results(index % CHUNKS)[name])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tiled_equals_dequantize_then_matmul(case: tuple[Any, ...]) -> None:
    name, m, n, dtype = case[0], case[5], case[6], case[8]
    got = _result(name)
    assert got["shape"] == [m, n] and got["dtype"] == f"torch.{dtype}"
    assert got["worst_over_bound"] <= 1.0, got
    assert got["same_bits_twice"] and got["tickets_zero"], got
    assert got["tiled"] == ("falls_back" not in name), got


def test_compiles_for_sm90() -> None:
    """Every variant through Triton's compiler for sm_90 (offline: no GPU), at M = 1 (with PDL) and M = 4."""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization.w4a16 import gemv_tiled as t\n"
        "fn = t._w4a16_gemv_tiled_kernel\n"
        "ptrs = {'x_ptr': '*bf16', 's_ptr': '*bf16', 'y_ptr': '*bf16', 'part_ptr': '*fp32'}\n"
        "for v, (pf, mant) in t.TILED_VARIANTS.items():\n"
        "    for rows, bk in ((1, 64 if pf else 128), (4, 32)):\n"
        "        cons = dict(GROUP_SIZE=128, BITS=4, ZERO_OFFSET=1, ROWS=rows, BLOCK_N=128, BLOCK_K=bk,\n"
        "                    FUSED_SPLIT=True, PREFETCH=pf, MANT=mant, X_BF16=True, PDL=rows == 1)\n"
        "        sig = {a: 'constexpr' if a in cons else ptrs.get(a, '*i32') if a.endswith('_ptr') else 'i32'\n"
        "               for a in fn.arg_names}\n"
        "        keys = {(fn.arg_names.index(k),): val for k, val in cons.items()}\n"
        "        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys),\n"
        "                           target=GPUTarget('cuda', 90, 32), options={'num_warps': 1})\n"
        "        ptx = k.asm['ptx']  # PDL (NOTE 6): prefetches, then the wait, before any load\n"
        "        assert ('griddepcontrol.wait' in ptx) == (rows == 1), (v, rows)\n"
        "        if rows == 1:\n"
        "            assert ptx.index('prefetch.global.L2') < ptx.index('griddepcontrol.wait') < ptx.index('ld.global')\n"
        "print('ok')\n"
    )
    compile_offline(code)


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]))))
