"""The W4A16 Triton GEMM (AWQ and GPTQ layouts) against dequantize-then-matmul, under Triton's interpreter.

As in test_triton_attention.py, TRITON_INTERPRET must be set before triton is first imported, so the cases
run in one child process (this file as a script) and the tests read its JSON. The reference is built from
the test packer's integer codes (quant_packers.QuantizedLinear.dense), in float64; the kernel sees only the
packed words. Shapes are tiny (the interpreter runs each program in numpy) but cover the block configs
(decode M <= 16, 17-63, the wide layers' 64-128, prefill M > 128), partial N tiles, split-K, act-order (g_idx read per input, and sorted by group as the method does), 2/4/8 bits, float32 and float16.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
from interpreter_child import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, kind, bits, group, act_order, v1, M, dtype, blocks: None = the launcher's table, else
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, SPLIT_K) to reach split-K, which the table picks only for big layers)
CASES = [
    ("awq4_decode", "awq", 4, 32, False, True, 1, "float32", None),
    ("awq4_prefill_fp16", "awq", 4, 64, False, True, 70, "float16", None),
    ("awq4_splitk", "awq", 4, 64, False, True, 2, "float32", (16, 32, 64, 4, 3)),
    ("gptq4_actorder_v1", "gptq", 4, 32, True, True, 5, "float32", None),
    ("gptq4_prefill", "gptq", 4, 32, False, True, 70, "float32", None),
    ("gptq4_actorder_splitk_fp16", "gptq", 4, 32, True, True, 4, "float16", (16, 32, 32, 4, 4)),
    ("gptq8_actorder_v2", "gptq", 8, 64, True, False, 17, "float32", None),
    ("gptq4_actorder_sorted", "gptq", 4, 32, "sorted", True, 6, "float32", None),
    ("gptq2_fp16", "gptq", 2, 32, False, False, 3, "float16", None),
    # kernel.py NOTE 6's wide-layer tiles (64 x 128 x 128 at 64 rows, 128 x 128 x 64 to 128) and the 64 x 64 x 64
    # prefill tile above; the launcher's table picks them by rows whatever N is
    ("gptq4_rows64_fp16", "gptq", 4, 64, False, True, 64, "float16", None),
    ("gptq4_rows130", "gptq", 4, 32, False, True, 130, "float32", None),
]
N, K = 96, 256  # N = 96: the 64-wide prefill tiles end in a partial tile


def _cases() -> dict[str, Any]:
    import torch
    from quant_packers import awq_pack, gptq_pack, quantize_rtn

    from pagedllm.plugins.quantization.w4a16.kernel import w4a16_gemm
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout, sort_act_order

    results: dict[str, Any] = {}
    for name, kind, bits, group, act_order, v1, m, dtype_name, blocks in CASES:
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(len(results))
        ql = quantize_rtn(torch.randn(N, K), bits, group, sym=False, act_order=act_order,
                          min_zero=1 if kind == "gptq" and v1 else 0)
        if kind == "awq":
            qweight, qzeros = awq_pack(ql.q, ql.z)
            layout, g_idx = PackedLayout("awq", 4, group), None
        else:
            qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=v1)
            layout, g_idx = PackedLayout("gptq", bits, group, 1 if v1 else 0), (ql.g_idx if act_order else None)
        x = torch.randn(m, K).to(dtype)
        x_in = x
        if act_order == "sorted":  # the method's load-time sort: inputs grouped, x permuted per call
            sorted_ = sort_act_order(layout, qweight, ql.g_idx)
            assert sorted_ is not None
            qweight, perm = sorted_
            g_idx, x_in = None, x[:, perm]
        y = w4a16_gemm(x_in, layout, qweight, qzeros, ql.s.to(dtype), g_idx, N, blocks=blocks)
        ref = x.double() @ ql.dense().double().t()
        results[name] = {
            "dtype": str(y.dtype), "shape": list(y.shape),
            "rel_err": float((y.double() - ref).norm() / ref.norm()),
        }
    return results


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, Any]:
    return dict(run_interpreted(__file__))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_dequantize_then_matmul(case: tuple[Any, ...], kernel_results: dict[str, Any]) -> None:
    name, m, dtype = case[0], case[6], case[7]
    got = kernel_results[name]
    assert got["shape"] == [m, N] and got["dtype"] == f"torch.{dtype}"
    # float32: accumulation order only; float16: the inputs, dequantized weights and output rounded to fp16.
    assert got["rel_err"] < (1e-5 if dtype == "float32" else 2e-3), got


if __name__ == "__main__":
    print(json.dumps(_cases()))
