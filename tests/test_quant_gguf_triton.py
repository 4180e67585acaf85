"""The Triton GGUF kernels (gguf/triton_gemm.py) against gguf-py, under Triton's interpreter; and an sm_90 compile.

Blocks: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 come from the `gguf` package's quantizer on random weights; gguf-py has
no K-quant quantizer, so Q2_K .. Q6_K blocks are random bytes with their f16 scale fields set to small
positive values (every other bit pattern is a valid code); one real matrix comes from the embedded SmolLM2
file (Q4_1). The reference weights are gguf-py's `dequantize` (float32).

As in test_quant_w4a16_gemv.py, TRITON_INTERPRET must be set before triton is first imported, so the cases run
in child processes (this file as a script) and the tests read their JSON. Checks:
    dequantize      our kernel's fp32 output == gguf-py's float32 bit for bit; fp16 == gguf-py's rounded once
    GEMV (M 1, 3)   |y - x @ W^T| <= 1e-6 * S (+ ulp16(y) for float16), S = |x| @ |W^T|, reference in float64
    scratch (M 64)  the same bound against x @ W_dtype^T: the scratch matrix holds W rounded to x's dtype, as a
                    model dequantized at load would
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

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# f16 scale fields of the K-quants (byte offsets in the block): set so random blocks decode to sane weights.
_K_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
N, K = 40, 512  # N not a multiple of any BLOCK_N; K two K-quant super-blocks, four GEMV steps
CHUNKS = 4


def _blocks(name: str, seed: int) -> Any:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    t = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    if name not in _K_SCALE_FIELDS:
        return quantize(rng.standard_normal((N, K)).astype(np.float32), t)
    qk, ts = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (N, K // qk, ts), dtype=np.uint8)
    for off in _K_SCALE_FIELDS[name]:
        d = (rng.random((N, K // qk)) * 0.01 + 1e-4).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(N, K // qk, 2)
    return raw.reshape(N, -1)


def _smollm2_blocks() -> tuple[Any, str, int, int]:
    """blk.0.attn_k.weight of the embedded SmolLM2 file: Q4_1, [192, 576]."""
    from gguf import GGUFReader

    from pagedllm.default_model import default_model_path

    tensor = next(t for t in GGUFReader(default_model_path()).tensors if t.name == "blk.0.attn_k.weight")
    n, k = int(tensor.shape[1]), int(tensor.shape[0])
    return tensor.data, tensor.tensor_type.name, n, k


def _check_case(blocks: Any, name: str, n: int, k: int, seed: int, ms: tuple[int, ...]) -> dict[str, Any]:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedllm.plugins.quantization.gguf.kernels import TritonKernel
    from pagedllm.plugins.quantization.gguf.triton_gemm import gemv_blocks, gguf_dequantize, gguf_gemv

    t = GGMLQuantizationType[name]
    ref_w = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, t), dtype=np.float32).reshape(n, k))
    data = torch.from_numpy(np.ascontiguousarray(blocks))
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float16):
        w = gguf_dequantize(data, int(t), k, dtype)
        out[f"dequant_{dtype}"] = bool(torch.equal(w, ref_w.to(dtype)))
    kernel = TritonKernel(data, int(t), (n, k), torch.device("cpu"))
    ids = torch.tensor([n - 1, 0, n // 2])
    out["rows"] = bool(torch.equal(kernel.rows(ids), ref_w[ids]))
    g = torch.Generator().manual_seed(seed)
    for m in ms:
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(m, k, generator=g).to(dtype)
            # The element-wise GEMV with the 8B shapes' tiles (fewer interpreted programs), but Q4_0 through the
            # kernel's own dispatch: the block-wise GEMV at M = 1, 3 (gguf/block_gemv.py), the scratch at 64.
            y = gguf_gemv(x, data, int(t), n, gemv_blocks(4096, m)) if m <= 8 and t != t.Q4_0 else kernel.forward(x)
            w_ref = ref_w.to(dtype).double() if m > 8 else ref_w.double()  # the scratch holds W in x's dtype
            ref = x.double() @ w_ref.t()
            size = x.double().abs() @ w_ref.abs().t()
            ulp16 = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-14))) - 10)
            bound = 1e-6 * size + (ulp16 if dtype == torch.float16 else 0.0)
            err = (y.double() - ref).abs()
            out[f"m{m}_{dtype}"] = {"shape": list(y.shape), "dtype": str(y.dtype),
                                    "worst_over_bound": float((err / bound).max())}
    return out


BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf/block_gemv.py's types
BLOCK_N_ROWS, BLOCK_K = 37, 32 * 9  # odd N; nine 32-weight blocks: not a multiple of BLOCK_B = 8 blocks
# (M, tiles): the default tiles (five n blocks, one partial step of 32 blocks, no split), BLOCK_B = 8 with
# split-K 2 (one full step, then one block; one or three n blocks) and one 64-row program (27 rows masked):
# every M from 1 to 4, float32 for odd M, float16 for even. Few programs: the interpreter's cost.
_BLOCK_CASES = [(1, None), (2, (64, 8, 1, 2)), (3, (16, 8, 1, 2)), (4, (64, 32, 1, 1))]


def _block_check(name: str, seed: int) -> dict[str, Any]:
    """The block-wise GEMV against x @ W^T, W gguf-py's dequantization of gguf-py's quantization, in float64."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from pagedllm.plugins.quantization.gguf.block_gemv import gguf_block_gemv

    t = GGMLQuantizationType[name]
    n, k = BLOCK_N_ROWS, BLOCK_K
    rng = np.random.default_rng(seed)
    blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    ref_w = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, t), dtype=np.float32).reshape(n, k)).double()
    data = torch.from_numpy(np.ascontiguousarray(blocks))
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for m, tiles in _BLOCK_CASES:
        dtype = torch.float32 if m % 2 else torch.float16
        x = torch.randn(m, k, generator=g).to(dtype)
        y = gguf_block_gemv(x, data, int(t), n, tiles)
        ref = x.double() @ ref_w.t()
        size = x.double().abs() @ ref_w.abs().t()
        ulp16 = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-14))) - 10)
        bound = 1e-6 * size + (ulp16 if dtype == torch.float16 else 0.0)
        out[f"m{m}"] = {"shape": list(y.shape), "dtype": str(y.dtype),
                        "worst_over_bound": float(((y.double() - ref).abs() / bound).max())}
        if m == 3:  # split-K: a second run gives the same bits
            out["same_bits"] = bool(torch.equal(y, gguf_block_gemv(x, data, int(t), n, tiles)))
    return out


def _run(chunk: int) -> dict[str, Any]:
    if chunk < 0:  # the block-wise GEMV's cases
        return {name: _block_check(name, 200 + i) for i, name in enumerate(BLOCK_TYPES)}
    results: dict[str, Any] = {}
    for i, name in enumerate(TYPES):
        if i % CHUNKS == chunk:
            results[name] = _check_case(_blocks(name, i), name, N, K, i, (1, 3, 64))
    if chunk == CHUNKS - 1:
        blocks, name, n, k = _smollm2_blocks()
        results["smollm2_attn_k"] = _check_case(blocks, name, n, k, 99, (1, 64)) | {"type": name}
    return results


@functools.cache
def _chunk_results(chunk: int) -> dict[str, Any]:
    return dict(run_interpreted(__file__, str(chunk)))


def _result(name: str) -> dict[str, Any]:
    chunk = CHUNKS - 1 if name not in TYPES else TYPES.index(name) % CHUNKS
    return dict(_chunk_results(chunk)[name])


def _assert_case(got: dict[str, Any], ms: tuple[int, ...], n: int) -> None:
    assert got["dequant_torch.float32"] and got["dequant_torch.float16"], got
    assert got["rows"], got
    for m in ms:
        for dtype in ("torch.float32", "torch.float16"):
            case = got[f"m{m}_{dtype}"]
            assert case["shape"] == [m, n] and case["dtype"] == dtype, case
            assert case["worst_over_bound"] <= 1.0, (m, dtype, case)


@pytest.mark.parametrize("name", TYPES)
def test_triton_kernels_equal_gguf_reference(name: str) -> None:
    _assert_case(_result(name), (1, 3, 64), N)


def test_smollm2_matrix() -> None:
    """A real matrix of the embedded model (Q4_1 [192, 576]): exact dequantization, GEMV and scratch path."""
    got = _result("smollm2_attn_k")
    assert got["type"] == "Q4_1"
    _assert_case(got, (1, 64), 192)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_block_gemv_equals_gguf_reference(name: str) -> None:
    """gguf/block_gemv.py within 1e-6 sum |x| |w| (+ half an fp16 ulp) of x @ W^T, M = 1..4, split-K, same bits."""
    got = dict(_chunk_results(-1)[name])
    for m, _ in _BLOCK_CASES:
        case = got[f"m{m}"]
        assert case["shape"] == [m, BLOCK_N_ROWS], case
        assert case["dtype"] == ("torch.float32" if m % 2 else "torch.float16"), case
        assert case["worst_over_bound"] <= 1.0, (m, case)
    assert got["same_bits"], got


def test_block_gemv_selection() -> None:
    """Pure Python: gguf_gemv hands the 32-weight types at M <= 4 to the block-wise GEMV, the rest not."""
    import torch

    from pagedllm.formats.gguf_blocks import Q
    from pagedllm.plugins.quantization.gguf.block_gemv import BLOCK_TYPES as IDS
    from pagedllm.plugins.quantization.gguf.block_gemv import block_reason, block_tiles

    assert {Q(t).name for t in IDS} == set(BLOCK_TYPES)
    blocks = torch.zeros(4, 18 * 4, dtype=torch.uint8)
    assert all(block_reason(torch.zeros(m, 128), blocks, int(Q.Q4_0)) is None for m in (1, 4))
    assert block_reason(torch.zeros(5, 128), blocks, int(Q.Q4_0)) is not None
    assert block_reason(torch.zeros(1, 256), blocks, int(Q.Q4_K)) is not None
    # the 8B shapes: split-K only where the column blocks alone leave SMs idle
    assert block_tiles(28672, 4096, 1)[3] == 1 and block_tiles(4096, 4096, 1)[3] > 1


def test_selection_reasons() -> None:
    """Pure Python: the CUDA selector takes every covered type and names the reason for the rest."""
    import torch

    from pagedllm.formats.gguf_blocks import Q
    from pagedllm.plugins.quantization.gguf import triton_gemm as gguf_triton
    from pagedllm.plugins.quantization.gguf.method import TRITON_TYPES, triton_reason

    assert {int(t) for t in TRITON_TYPES} == set(gguf_triton.TRITON_TYPES)
    assert {t.name for t in TRITON_TYPES} == set(TYPES)
    cuda = torch.device("cuda")
    assert all(triton_reason(t, cuda) is None for t in TRITON_TYPES)
    reason = triton_reason(Q.IQ2_XXS, cuda)
    assert reason is not None and "IQ2_XXS" in reason
    assert triton_reason(Q.Q4_0, torch.device("cpu")) is not None


def test_compiles_for_sm90() -> None:
    """Every kernel variant through Triton's compiler for sm_90 (offline: no GPU): the dequantize kernel per type
    (bf16, fp16 and fp32 out), the GEMV per type at M = 1 and 3, and at M = 8 for a 32-block and a K-quant type."""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization.gguf import triton_gemm as g\n"
        "def comp(fn, cons, ptrs, fusion=True):\n"
        "    sig = {a: 'constexpr' if a in cons else ptrs.get(a, '*u8') if a.endswith('_ptr') else 'i32'\n"
        "           for a in fn.arg_names}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys), target=GPUTarget('cuda', 90, 32),\n"
        "                   options={'num_warps': 4, 'enable_fp_fusion': fusion})\n"
        "for t, (qk, ts) in g.TRITON_TYPES.items():\n"
        "    for dt in ('*bf16', '*fp16', '*fp32'):\n"
        "        comp(g._gguf_dequant_kernel, dict(TYPE=t, QK=qk, TS=ts, BLOCK_N=16, BLOCK_K=256), {'out_ptr': dt},\n"
        "             fusion=False)\n"
        "    for rows in (1, 3, 8) if t in (2, 14) else (1, 3):\n"
        "        bn, bk, _ = g.gemv_blocks(4096, rows)\n"
        "        comp(g._gguf_gemv_kernel, dict(TYPE=t, QK=qk, TS=ts, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk),\n"
        "             {'x_ptr': '*bf16', 'y_ptr': '*bf16'})\n"
        "print('ok')\n"
    )
    compile_offline(code)


def test_block_gemv_compiles_for_sm90() -> None:
    """The block-wise GEMV through Triton and ptxas for sm_90a (offline), bf16 activations, split-K on: every type
    at M = 1, the two most register-hungry at M = 4; no spills (registers per variant printed by the child)."""
    code = PTXAS_SM90A + (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization.gguf import block_gemv as g\n"
        "fn = g._gguf_block_gemv_kernel\n"
        "for t, rows in [(t, 1) for t in g.BLOCK_TYPES] + [(2, 4), (7, 4)]:\n"
        "    bn, bb, warps, _ = g.block_tiles(4096, 4096, rows)\n"
        "    cons = dict(TYPE=t, TS=g.BLOCK_TYPES[t], ROWS=rows, BLOCK_N=bn, BLOCK_B=bb, FUSED_SPLIT=True)\n"
        "    ptrs = {'x_ptr': '*bf16', 'y_ptr': '*bf16', 'part_ptr': '*fp32', 'ticket_ptr': '*i32'}\n"
        "    sig = {a: 'constexpr' if a in cons else ptrs.get(a, '*u8') if a.endswith('_ptr') else 'i32'\n"
        "           for a in fn.arg_names}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    attrs = {(i,): [['tt.divisibility', 16]] for i, a in enumerate(fn.arg_names)\n"
        "             if a.endswith('_ptr') or a.startswith('stride')}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys, attrs=attrs),\n"
        "                       target=GPUTarget('cuda', 90, 32), options={'num_warps': warps})\n"
        "    print(t, rows, ptxas_sm90a(k))\n"
        "print('ok')\n"
    )
    print(compile_offline(code))


if __name__ == "__main__":
    print(json.dumps(_run(int(sys.argv[1]))))
