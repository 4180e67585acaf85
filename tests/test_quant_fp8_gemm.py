"""The FP8 W8A8 Triton GEMM (plugins/quantization/fp8/gemm.py): its products against a float32 product of the
same e4m3 operands under Triton's interpreter (every tile kind: swapped 16- and 64-row tiles, the wide
unswapped tile, split-K), its routing rule on the Llama-3.1-8B shapes, and its tiles through the sm_90
compiler (wgmma in FP8 mode, no spills)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest
from interpreter_child import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

sys.path.insert(0, os.path.dirname(__file__))
from offline_compile import compile_offline  # noqa: E402

# name: (M, N, K, blocks or None for the rule's (132 SMs), static activation scale)
CASES: dict[str, tuple[int, int, int, tuple[int, ...] | None, float | None]] = {
    "swap16_rule": (5, 128, 512, None, None),
    "swap64_rule": (40, 128, 512, None, None),
    "swap64_static": (40, 128, 512, None, 0.02),
    "wide_unswapped": (20, 256, 512, (0, 64, 128, 128, 1, 4, 4), None),
    "split_k": (9, 128, 1024, (1, 16, 64, 256, 2, 4, 4), None),
}


def _run() -> dict[str, Any]:
    import torch

    from pagedllm.plugins.quantization.fp8.gemm import Fp8GemmBlocks, fp8_gemm, fp8_gemm_blocks
    from pagedllm.plugins.quantization.fp8.method import quantize_activations_torch, quantize_rows

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for name, (m, n, k, blocks, static) in CASES.items():
        x = (torch.randn(m, k, generator=gen) * 0.5).to(torch.float16)
        w_q, s = quantize_rows(torch.randn(n, k, generator=gen) * 0.02)
        x_q, a = quantize_activations_torch(x, None if static is None else torch.tensor([[static]]))
        ref = (x_q.float() * a) @ (w_q.float() * s.float()[:, None]).t()
        b = Fp8GemmBlocks(*blocks) if blocks else fp8_gemm_blocks(m, n, k, 132)
        y = fp8_gemm(x_q, a, w_q, s.float(), torch.float16, blocks=b)
        out[name] = {"blocks": list(b), "dtype": str(y.dtype), "shape": list(y.shape),
                     "err": float((y.float() - ref).abs().max() / ref.abs().max())}
    return out


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    return dict(run_interpreted(__file__))


@pytest.mark.parametrize("case", list(CASES))
def test_products_match_a_float32_product_of_the_same_operands(interp: dict[str, Any], case: str) -> None:
    m, n, _, blocks, _ = CASES[case]
    got = interp[case]
    assert got["shape"] == [m, n] and got["dtype"] == "torch.float16"
    if blocks is not None:
        assert got["blocks"] == list(blocks)
    assert got["err"] < 2e-3, got  # float16 output rounding; a wrong scale or tile is off by O(1)


def test_rule_on_the_8b_shapes() -> None:
    from pagedllm.plugins.quantization.fp8.gemm import fp8_gemm_blocks, use_fp8_gemm

    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    for n, k in (qkv, o, gate_up, down):
        assert all(use_fp8_gemm(m, n, k, 132) for m in (3, 4, 16, 17, 64))
        assert not use_fp8_gemm(256, n, k, 132)  # cuBLASLt's tile is full there (the probe's finding)
    assert use_fp8_gemm(128, *o, 132) and use_fp8_gemm(128, *down, 132)
    assert not use_fp8_gemm(128, *gate_up, 132)  # 224 cuBLASLt tiles: more than the SMs
    assert not use_fp8_gemm(8, 4100, 4096, 132) and not use_fp8_gemm(8, 4096, 4000, 132)  # unmasked N, K
    assert fp8_gemm_blocks(8, *o, 132)[:5] == (1, 16, 64, 256, 1)
    assert fp8_gemm_blocks(8, *down, 132)[:5] == (1, 16, 64, 256, 2)  # a long K split toward one program per SM
    assert fp8_gemm_blocks(64, *down, 132)[:5] == (1, 64, 64, 256, 1)
    assert fp8_gemm_blocks(40, *gate_up, 132)[:5] == (0, 64, 128, 128, 1)


def test_tiles_compile_for_sm90_with_fp8_wgmma() -> None:
    """Every tile the rule picks on the 8B shapes lowers to FP8 wgmma within an SM's shared memory. (Spills are
    not asserted: the CPU machines' Triton is newer than the GPU machine's, which the tiles were measured on.)"""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization.fp8.gemm import _fp8_gemm_kernel as fn, fp8_gemm_blocks\n"
        "for m, n, k in ((8, 4096, 4096), (8, 4096, 14336), (64, 6144, 4096), (40, 28672, 4096)):\n"
        "    b = fp8_gemm_blocks(m, n, k, 132)\n"
        "    sig = {'xq_ptr': '*fp8e4nv', 'a_ptr': '*fp32', 'w_ptr': '*fp8e4nv', 's_ptr': '*fp32',\n"
        "           'y_ptr': '*fp32' if b.split_k > 1 else '*bf16', 'M': 'i32', 'N': 'i32', 'K': 'i32',\n"
        "           'K_PER_SPLIT': 'i32'}\n"
        "    cons = dict(SWAP=b.swap, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k, SPLIT_K=b.split_k)\n"
        "    sig.update({key: 'constexpr' for key in cons})\n"
        "    keys = {(fn.arg_names.index(key),): v for key, v in cons.items()}\n"
        "    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys), target=GPUTarget('cuda', 90, 32),\n"
        "                       options={'num_warps': b.warps, 'num_stages': b.stages})\n"
        "    ptx = c.asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'e4m3' in ptx, b\n"
        "    assert c.metadata.shared <= 227 * 1024, c.metadata.shared\n"
        "    print(b, c.metadata.shared)\n"
        "print('ok')\n"
    )
    print(compile_offline(code))


if __name__ == "__main__":
    print(json.dumps(_run()))
