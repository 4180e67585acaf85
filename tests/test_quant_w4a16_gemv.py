"""The W4A16 decode GEMV against dequantize-then-matmul, under Triton's interpreter: GPTQ (v1, v2, sym;
2/4/8 bits) and AWQ checkpoints (repacked into the GPTQ order by awq_to_gptq, as the method does at load).

As in test_quant_awq_gptq_kernel.py, TRITON_INTERPRET must be set before triton is first imported, so the
cases run in child processes (this file as a script, CHUNKS of them, to keep each test under 20 s) and the
tests read their JSON. The reference is w4a16_layout.dequantize of the checkpoint's own tensors (for AWQ: before
repacking) in float64 times x in float64; the kernel sees only the packed words.

Bound, elementwise, with S = |x| @ |W^T| (the size of the terms summed):
    float32 activations   |y - ref| <= 1e-6 * S                  accumulation order only
    float16 activations   |y - ref| <= ulp16(ref) + 1e-6 * S     plus the one rounding of y to float16
(x and the scales are the same float16 values in both; the kernel never rounds the weights to float16.)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from typing import Any

import pytest
from interpreter_child import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, kind, bits, group, zeros, M, N, K, dtype, blocks): zeros "v1" / "v2" asymmetric, "sym" (v1, z = 2^(b-1));
# blocks None = gemv_blocks' choice, else (BLOCK_N, BLOCK_K, warps, SPLIT_K).
CASES = [
    *[(f"awq_m{m}_{d}", "awq", 4, 128, "v2", m, 200, 512, d, None)
      for m in (1, 3, 8) for d in ("float32", "float16")],
    ("awq_blocks_tail_split3", "awq", 4, 64, "v2", 2, 200, 256, "float16", (64, 32, 2, 3)),
    ("awq_m5_fp16", "awq", 4, 64, "v2", 5, 120, 256, "float16", None),
    ("awq_group32", "awq", 4, 32, "v2", 1, 120, 256, "float32", None),
    *[(f"gptq_v1_m{m}_{d}", "gptq", 4, 128, "v1", m, 200, 512, d, None)
      for m in (1, 3, 8) for d in ("float32", "float16")],
    ("gptq_v2_m1", "gptq", 4, 128, "v2", 1, 200, 512, "float32", None),
    ("gptq_sym_m3_fp16", "gptq", 4, 128, "sym", 3, 200, 512, "float16", None),
    ("gptq_blocks_tail_split3", "gptq", 4, 64, "v1", 2, 200, 256, "float32", (64, 32, 2, 3)),
    ("gptq8_m2", "gptq", 8, 64, "v1", 2, 120, 256, "float32", None),
    ("gptq2_m1_fp16", "gptq", 2, 64, "v2", 1, 208, 256, "float16", None),
]


CHUNKS = 6  # case i runs in child i % CHUNKS


def _run(chunk: int) -> dict[str, Any]:
    import torch
    from quant_packers import awq_pack, gptq_pack, quantize_rtn

    from pagedllm.plugins.quantization.w4a16.gemv import gemv_blocks, w4a16_gemv
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout, awq_to_gptq, dequantize

    results: dict[str, Any] = {}
    for i, (name, kind, bits, group, zeros, m, n, k, dtype_name, blocks) in enumerate(CASES):
        if i % CHUNKS != chunk:
            continue
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(i)
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
        # the base kernel's exactness bounds (the tiled variants, the default since the H200 sweep, have their
        # own test file and bounds: test_quant_w4a16_gemv_tiled.py)
        y = w4a16_gemv(x, layout, qweight, qzeros, scales, n, blocks=blocks, variant="base")
        ref = x.double() @ w_t
        size = x.double().abs() @ w_t.abs()
        err = (y.double() - ref).abs()
        ulp16 = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-14))) - 10)
        bound = 1e-6 * size + (ulp16 if dtype == torch.float16 else 0.0)
        results[name] = {
            "dtype": str(y.dtype), "shape": list(y.shape),
            "blocks": list(blocks or gemv_blocks(layout, m, n, k)),
            "rel_err": float((y.double() - ref).norm() / ref.norm()),
            "worst_over_bound": float((err / bound).max()),
        }
    return results


@functools.cache
def _chunk_results(chunk: int) -> dict[str, Any]:
    return dict(run_interpreted(__file__, str(chunk)))


def _result(name: str) -> dict[str, Any]:
    index = [c[0] for c in CASES].index(name)
    return dict(_chunk_results(index % CHUNKS)[name])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gemv_equals_dequantize_then_matmul(case: tuple[Any, ...]) -> None:
    name, m, n, dtype = case[0], case[5], case[6], case[8]
    got = _result(name)
    assert got["shape"] == [m, n] and got["dtype"] == f"torch.{dtype}"
    assert got["worst_over_bound"] <= 1.0, got


def test_default_blocks_cover_split_and_direct_paths() -> None:
    """The table's M = 1 choice splits K (partials + _sum_splits_kernel); M = 8 writes y directly."""
    assert _result("awq_m1_float32")["blocks"][3] > 1
    assert _result("gptq_v1_m8_float32")["blocks"][3] == 1


def test_dispatch_and_blocks_for_the_8b_shapes() -> None:
    """Pure Python (no kernel runs): who takes the GEMV, and what the table gives the Llama-3.1-8B layers."""
    import torch

    from pagedllm.plugins.quantization.w4a16.gemv import GEMV_MAX_M, gemv_blocks, gemv_reason
    from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

    lay = PackedLayout("gptq", 4, 128, 1)
    assert gemv_reason(lay, 1, None) is None and gemv_reason(lay, GEMV_MAX_M, None) is None
    assert gemv_reason(lay, GEMV_MAX_M + 1, None) is not None
    assert gemv_reason(lay, 1, torch.zeros(4096, dtype=torch.int32)) is not None  # act-order: the GEMM
    assert gemv_reason(PackedLayout("awq", 4, 128), 1, None) is not None  # repacked at load first
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for m in (1, 4, 8):
            bn, bk, _, split = gemv_blocks(lay, m, n, k)
            assert 128 % bk == 0 and k % bk == 0 and bk % 8 == 0
            programs = -(-n // bn) * split
            assert programs >= 132 * 2 or split == k // (64 * m), (n, k, m, programs)
            assert split * m * n * 4 <= n * k // 2 // 8  # float32 partials <= 1/8 of the 4-bit weight


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]))))
