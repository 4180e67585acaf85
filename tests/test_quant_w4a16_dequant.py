"""The large-M W4A16 path (w4a16/dequant.py): the Triton dequantization kernel and dequantize + matmul.

As in test_quant_w4a16_gemv.py, TRITON_INTERPRET must be set before triton is first imported, so the kernel
cases run in child processes (this file as a script, CHUNKS of them) and the tests read their JSON.

- the kernel's W^T equals w4a16_layout.dequantize in the same dtype, bit for bit (NOTE 1 of the module): AWQ in
  its own order and repacked into the GPTQ order, GPTQ 2/4/8 bits, v1 / v2 / sym zeros, act-order with g_idx
  kept and sorted at load, group -1 (one group per row: the method passes group = K), a group smaller than the
  tile, N and K that end in partial tiles, float16 / float32, scales in another dtype than the output;
- w4a16_matmul at M >= DEQUANT_MIN_M equals dequantize-then-matmul in the activation dtype (the same torch
  matmul on the same weights, so bit for bit) and is within the dtype's rounding of a float64 reference.
The dispatch by rows is checked in-process with the kernels replaced by stubs; the kernel is compiled for
sm_90 offline (registers, no spills) in a child without the interpreter.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from typing import Any

import pytest
from interpreter_child import run_interpreted
from offline_compile import PTXAS_SM90A, compile_offline

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, kind, bits, group, zeros, act_order, N, K, dtype, scales dtype, M): zeros "v1" / "v2" / "sym" (v1,
# z = 2^(b-1)); act_order False / True (g_idx kept) / "sorted" (the method's load-time sort); kind "awq_raw" is
# AWQ's own packing, "awq" the GPTQ-order repack the method keeps; M > 0 also runs w4a16_matmul with M rows.
CASES = [
    ("awq_raw_fp16", "awq_raw", 4, 64, "v2", False, 200, 256, "float16", "float16", 0),
    ("awq_raw_group32_fp32", "awq_raw", 4, 32, "v2", False, 72, 96, "float32", "float32", 0),
    ("awq_repacked_fp16", "awq", 4, 128, "v2", False, 200, 512, "float16", "float16", 130),
    ("gptq4_v1_fp32", "gptq", 4, 128, "v1", False, 200, 512, "float32", "float32", 128),
    ("gptq4_v2_fp16", "gptq", 4, 64, "v2", False, 136, 256, "float16", "float16", 0),
    ("gptq4_sym_fp16", "gptq", 4, 128, "sym", False, 96, 256, "float16", "float16", 0),
    ("gptq8_v1_fp16", "gptq", 8, 64, "v1", False, 120, 256, "float16", "float16", 129),
    ("gptq8_v2_fp32", "gptq", 8, 32, "v2", False, 200, 128, "float32", "float32", 0),
    ("gptq2_v2_fp16", "gptq", 2, 64, "v2", False, 208, 256, "float16", "float16", 0),
    ("gptq4_actorder_gidx_fp16", "gptq", 4, 32, "v1", True, 96, 256, "float16", "float16", 140),
    ("gptq8_actorder_gidx_fp32", "gptq", 8, 64, "v2", True, 72, 256, "float32", "float32", 0),
    ("gptq4_actorder_sorted_fp16", "gptq", 4, 32, "v1", "sorted", 96, 256, "float16", "float16", 130),
    ("gptq4_channelwise_fp16", "gptq", 4, -1, "v1", False, 200, 320, "float16", "float16", 0),
    ("gptq4_group48_fp16", "gptq", 4, 48, "v2", False, 72, 192, "float16", "float16", 0),
    ("gptq4_fp32_scales_fp16_out", "gptq", 4, 128, "v1", False, 104, 256, "float16", "float32", 0),
    ("gptq4_fp16_scales_fp32_out", "gptq", 4, 64, "v2", False, 104, 256, "float32", "float16", 0),
]

CHUNKS = 4  # case i runs in child i % CHUNKS


def _case(name: str) -> tuple[Any, ...]:
    return next(c for c in CASES if c[0] == name)


def _run(chunk: int) -> dict[str, Any]:
    import torch
    from quant_packers import awq_pack, gptq_pack, quantize_rtn

    from pagedllm.plugins.quantization.w4a16.dequant import DEQUANT_MIN_M, dequant_blocks, w4a16_dequantize
    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_matmul
    from pagedllm.plugins.quantization.w4a16.layout import (
        PackedLayout,
        awq_to_gptq,
        dequantize,
        sort_act_order,
    )

    results: dict[str, Any] = {}
    for i, (name, kind, bits, group, zeros, act_order, n, k, dtype_name, s_dtype_name, m) in enumerate(CASES):
        if i % CHUNKS != chunk:
            continue
        dtype, s_dtype = getattr(torch, dtype_name), getattr(torch, s_dtype_name)
        torch.manual_seed(i)
        group = group if group > 0 else k  # group_size -1: the method hands the kernels group = K
        ql = quantize_rtn(torch.randn(n, k), bits, group, sym=zeros == "sym", act_order=bool(act_order),
                          min_zero=1 if zeros != "v2" else 0)
        g_idx = None
        if kind.startswith("awq"):
            qweight, qzeros = awq_pack(ql.q, ql.z)
            layout = PackedLayout("awq", 4, group)
            if kind == "awq":
                layout, qweight, qzeros = awq_to_gptq(layout, qweight, qzeros, rows_per_chunk=64)
        else:
            qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=zeros != "v2")
            layout = PackedLayout("gptq", bits, group, 0 if zeros == "v2" else 1)
            g_idx = ql.g_idx if act_order is True else None
        perm = None
        if act_order == "sorted":
            sorted_ = sort_act_order(layout, qweight, ql.g_idx)
            assert sorted_ is not None
            qweight, perm = sorted_
        scales = ql.s.to(s_dtype)
        w_t = w4a16_dequantize(layout, qweight, qzeros, scales, g_idx, n, dtype)
        ref = dequantize(layout, qweight, qzeros, scales, g_idx, dtype=dtype)
        codes_w_t = ql.dense().double().t()  # [K, N]; sorted act-order rows are permuted like the codes
        codes_w_t = codes_w_t[perm] if perm is not None else codes_w_t
        out: dict[str, Any] = {
            "shape": list(w_t.shape), "dtype": str(w_t.dtype), "blocks": list(dequant_blocks(layout, g_idx is not None)),
            "bits_equal": bool(torch.equal(w_t, ref)),
            "max_abs_diff": float((w_t.double() - ref.double()).abs().max()),
            # the codes' own weights (test packer's integers, float64): the dtype's rounding only
            "vs_codes": float((w_t.double() - codes_w_t).abs().max()),
        }
        if m:
            assert m >= DEQUANT_MIN_M
            x = torch.randn(1, m, k).to(dtype)  # 3-D, as a model's [batch, tokens, hidden]
            x_in = x.index_select(-1, perm) if perm is not None else x
            y = w4a16_matmul(x_in, layout, qweight, qzeros, scales, g_idx, n)
            same_dtype = torch.matmul(x_in, ref)
            exact = x.double() @ ql.dense().double().t()
            size = x.double().abs() @ ql.dense().double().t().abs()
            unit = 2.0**-11 if dtype == torch.float16 else 2.0**-24  # half an ulp, relative
            out.update({
                "y_shape": list(y.shape), "y_dtype": str(y.dtype),
                "y_equals_dequantize_then_matmul": bool(torch.equal(y, same_dtype)),
                # weights and output each rounded once to the dtype (a unit of S each) + float32 accumulation
                "y_worst_over_bound": float(((y.double() - exact).abs() / ((2 * unit + 1e-6) * size)).max()),
            })
        results[name] = out
    return results


@functools.cache
def _chunk_results(chunk: int) -> dict[str, Any]:
    return dict(run_interpreted(__file__, str(chunk)))


def _result(name: str) -> dict[str, Any]:
    index = [c[0] for c in CASES].index(name)
    return dict(_chunk_results(index % CHUNKS)[name])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dequantize_kernel_equals_torch_reference(case: tuple[Any, ...]) -> None:
    name, n, k, dtype = case[0], case[6], case[7], case[8]
    got = _result(name)
    assert got["shape"] == [k, n] and got["dtype"] == f"torch.{dtype}"
    assert got["bits_equal"], got
    # and the reference itself decodes the packer's integers: exact in float32, one rounding in float16
    # (|w| < 8 here, so half an ulp of float16 is at most 2^-8)
    assert got["vs_codes"] <= (2.0**-8 if dtype == "float16" else 1e-6), got


@pytest.mark.parametrize("case", [c for c in CASES if c[10]], ids=[c[0] for c in CASES if c[10]])
def test_large_m_matmul_is_dequantize_then_matmul(case: tuple[Any, ...]) -> None:
    name, n, dtype, m = case[0], case[6], case[8], case[10]
    got = _result(name)
    assert got["y_shape"] == [1, m, n] and got["y_dtype"] == f"torch.{dtype}"
    assert got["y_equals_dequantize_then_matmul"], got
    assert got["y_worst_over_bound"] <= 1.0, got


def test_the_cases_reach_both_group_paths() -> None:
    """One-group tiles (zeros and scales once per tile) and per-input groups (act-order, group 48 < tile)."""
    assert _result("gptq4_v1_fp32")["blocks"][2] is True
    assert _result("gptq4_actorder_gidx_fp16")["blocks"][2] is False
    assert _result("gptq4_group48_fp16")["blocks"][:3] == [2, 128, True]  # 16 inputs per tile divide 48


def test_dispatch_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV up to GEMV_MAX_M rows, the GEMM up to DEQUANT_MIN_M - 1, dequantize + cuBLAS from DEQUANT_MIN_M
    (kernels replaced by stubs: no Triton launch); act-order g_idx skips the GEMV but not the large-M path.
    Off CUDA the 9-16 row route (the tensor-core GEMV in slices) falls back to the GEMM."""
    import torch

    from pagedllm.plugins.quantization.w4a16 import kernel as w4a16_kernel
    from pagedllm.plugins.quantization.w4a16.dequant import DEQUANT_MIN_M
    from pagedllm.plugins.quantization.w4a16.gemv import GEMV_MAX_M
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

    calls: list[str] = []
    for name in ("w4a16_gemv", "w4a16_gemm", "w4a16_dequant_matmul"):
        monkeypatch.setattr(w4a16_kernel, name, lambda *a, _n=name, **kw: calls.append(_n))
    lay = PackedLayout("gptq", 4, 128, 1)
    g_idx = torch.zeros(256, dtype=torch.int32)
    expected = []
    for m, g in [(1, None), (GEMV_MAX_M, None), (GEMV_MAX_M + 1, None), (16, None), (DEQUANT_MIN_M - 1, None),
                 (DEQUANT_MIN_M, None), (8192, None), (1, g_idx), (DEQUANT_MIN_M, g_idx)]:
        w4a16_kernel.w4a16_matmul(torch.zeros(m, 256), lay, None, None, None, g, 64)  # type: ignore[arg-type]
        expected.append("w4a16_gemv" if m <= GEMV_MAX_M and g is None else
                        "w4a16_dequant_matmul" if m >= DEQUANT_MIN_M else "w4a16_gemm")
    assert calls == expected
    assert expected.count("w4a16_dequant_matmul") == 3


def test_compiles_for_sm90() -> None:
    """The kernel through Triton's compiler for sm_90 (offline: no GPU), bf16 output, the 8B layers' layout
    (4-bit GPTQ order, group 128, one-group tiles), act-order, 8 bits and AWQ's own order: no spills."""
    code = PTXAS_SM90A + (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization.w4a16 import dequant as d\n"
        "fn = d._w4a16_dequant_kernel\n"
        "for bits, awq, gidx, one, bc in ((4, False, False, True, 128), (4, False, True, False, 128),\n"
        "                                 (8, False, False, True, 128), (4, True, False, True, 32)):\n"
        "    cons = dict(GROUP_SIZE=128, BITS=bits, AWQ=awq, HAS_G_IDX=gidx, ONE_GROUP=one, ZERO_OFFSET=1,\n"
        "                BLOCK_R=16, BLOCK_C=bc)\n"
        "    ptrs = {'s_ptr': '*bf16', 'out_ptr': '*bf16'}\n"
        "    sig = {a: 'constexpr' if a in cons else ptrs.get(a, '*i32') if a.endswith('_ptr') else 'i32'\n"
        "           for a in fn.arg_names}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    attrs = {(i,): [['tt.divisibility', 16]] for i, a in enumerate(fn.arg_names) if a not in cons}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys, attrs=attrs),\n"
        "                       target=GPUTarget('cuda', 90, 32), options={'num_warps': 4})\n"
        "    ptxas_sm90a(k)\n"
        "print('ok')\n"
    )
    compile_offline(code)


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]))))
