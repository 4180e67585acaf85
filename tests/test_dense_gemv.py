"""The dense decode GEMV (core/layers/dense_gemv_kernel.py, shared by the unquantized and FP8 methods) against torch's
matmul, under Triton's interpreter, and its dispatch rule (dense_gemv.py).

Kernel cases run in a child process (this file as a script: TRITON_INTERPRET is set before triton is
imported) and the tests read its JSON. Bound, elementwise, with S = |x| @ |W|^T computed in float64:
    float32   |y - ref| <= 2e-7 * S                  summation order only (K <= 1040 here)
    float16   |y - ref| <= ulp16(ref) + 2e-7 * S     plus the one rounding of y to float16
    gated     x = silu(gate) * up as SiluAndMul's torch code rounds it; float16: 2e-4 * S (an input's ulp)
and against F.linear in the same dtype on the CPU: at most one float16 ulp apart. FP8 weights (NOTE 7: e4m3 with a
float32 scale per row) against float64 products of the same e4m3 values times their scales, within the same
bounds, and through the FP8 linear method's decode route. Split-K cases also check
the in-kernel sum (NOTE 2): the same bits on a second run, tickets back to zero. bf16 is not run: the
interpreter's bf16 math is wrong (the GPU sweep, examples/gpu/gemv_sweep.py, checks bf16 against cuBLAS).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any, cast

import pytest
import torch
from interpreter_child import run_interpreted
from offline_compile import compile_offline

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, M, N, K, dtype, bias, blocks (BLOCK_N, BLOCK_K, warps, SPLIT_K), gated: x = [gate | up] of 2K)
CASES = [
    ("m1_fp32_even_direct", 1, 64, 512, "float32", False, (8, 256, 1, 1), False),
    ("m1_fp32_odd_n_split3", 1, 200, 768, "float32", False, (8, 256, 1, 3), False),
    ("m2_fp16_even_split4_bias", 2, 96, 1024, "float16", True, (4, 256, 1, 4), False),
    ("m3_fp16_odd_k_split2_bias", 3, 136, 520, "float16", True, (8, 128, 1, 2), False),
    ("m4_fp32_odd_both_direct", 4, 37, 1040, "float32", False, (2, 512, 2, 1), False),
    ("m4_fp16_split_uneven", 4, 64, 768, "float16", False, (16, 128, 1, 5), False),
    ("m1_fp16_gated_split2", 1, 64, 512, "float16", False, (8, 128, 1, 2), True),
    ("m3_fp32_gated_odd", 3, 40, 264, "float32", False, (8, 64, 1, 3), True),
    # the M = 1 rule's shapes of blocks (dense_gemv NOTE 4): 4 rows x 2048, one step; 512-wide split in 4 of 7 steps
    ("m1_fp16_rule_wide_one_step", 1, 48, 2048, "float16", False, (4, 2048, 8, 1), False),
    ("m1_fp32_rule_split4_of_7", 1, 40, 3584, "float32", False, (4, 512, 2, 4), False),
]


# (name, M, N, K, activation dtype, bias, blocks): e4m3 weights, one float32 scale per row (kernel NOTE 7)
FP8_CASES = [
    ("fp8_m1_fp16_split2_bias", 1, 64, 512, "float16", True, (8, 128, 1, 2)),
    ("fp8_m4_fp32_odd_direct", 4, 37, 520, "float32", False, (2, 128, 1, 1)),
    ("fp8_m2_fp16_rule_wide", 2, 48, 1024, "float16", False, (4, 1024, 4, 1)),
]


def _output_ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | float:
    """One float16 ulp of each reference value (the kernel's one rounding of y), 0 for float32 outputs."""
    if dtype != torch.float16:
        return 0.0
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-14))) - 10)


def _fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows in e4m3 with a per-row scale (the FP8 method's quantize_rows: max|row| / 448 per row)."""
    w = torch.randn(n, k) * 0.05 * torch.linspace(0.5, 4.0, n)[:, None]  # rows of different ranges
    scale = w.abs().amax(dim=1) / 448.0
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def _run_fp8(results: dict[str, Any]) -> None:
    from pagedllm.layers import dense_gemv_kernel as kernel

    for i, (name, m, n, k, dtype_name, has_bias, blocks) in enumerate(FP8_CASES):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(100 + i)
        x = torch.randn(m, k).to(dtype)
        w_q, scale = _fp8_weight(n, k)
        b = (torch.randn(n) * 0.1).to(dtype) if has_bias else None
        y = kernel.dense_gemv(x, w_q, b, blocks, row_scale=scale)
        w = w_q.double() * scale.double()[:, None]
        ref = x.double() @ w.T + (b.double() if b is not None else 0.0)
        size = x.double().abs() @ w.abs().T
        ulp = _output_ulp(ref, dtype)
        results[name] = {"dtype": str(y.dtype), "shape": list(y.shape),
                         "worst_over_bound": float(((y.double() - ref).abs() / (2e-7 * size + ulp)).max()),
                         "same_bits_twice": bool(torch.equal(y, kernel.dense_gemv(x, w_q, b, blocks, row_scale=scale)))}
    # The FP8 method's decode route: its layer (weights quantized while loading) through the GEMV where the rule
    # gives blocks -- here forced, as the rule declines CPU tensors -- against its own CPU path (dequantized).
    from pagedllm.layers.dense_gemv import DenseGemvBlocks
    from pagedllm.plugins.quantization.fp8 import method as fp8_method

    layer = torch.nn.Module()
    layer.output_partition_sizes = [24, 40]  # type: ignore[assignment]
    scheme = fp8_method.Fp8Scheme(checkpoint_fp8=False, weight_strategy="channel", activations="dynamic")
    meth = fp8_method.Fp8LinearMethod(scheme)
    meth.create_weights(layer, 256, [24, 40], torch.float16)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(64, 256) * 0.05).to(torch.float16))
    meth.process_weights_after_loading(layer)
    x = torch.randn(3, 256).to(torch.float16)
    cpu_path = meth.apply(layer, x, None)
    saved = fp8_method.gemv_blocks
    fp8_method.gemv_blocks = lambda *a: DenseGemvBlocks(8, 128, 1, 2)  # type: ignore[assignment]
    try:
        routed = meth.apply(layer, x, None)
    finally:
        fp8_method.gemv_blocks = saved
    results["fp8_method_route"] = {"max_rel": float((routed.double() - cpu_path.double()).abs().max()
                                                    / cpu_path.double().abs().max())}


def _run() -> dict[str, Any]:
    import torch.nn.functional as F

    from pagedllm.layers import dense_gemv_kernel as kernel
    from pagedllm.layers import split_k

    results: dict[str, Any] = {}
    for i, (name, m, n, k, dtype_name, has_bias, blocks, gated) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(i)
        x_in = torch.randn(m, 2 * k if gated else k).to(dtype)
        # gated: the values the two-launch path would store (SiluAndMul's torch code rounds where the kernel does)
        x = F.silu(x_in[:, :k]) * x_in[:, k:] if gated else x_in
        w = (torch.randn(n, k) * 0.05).to(dtype)
        b = (torch.randn(n) * 0.1).to(dtype) if has_bias else None
        y = kernel.dense_gemv(x_in, w, b, blocks, gated=gated)
        again = kernel.dense_gemv(x_in, w, b, blocks, gated=gated)
        ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
        size = x.double().abs() @ w.double().abs().T
        err = (y.double() - ref).abs()
        ulp = _output_ulp(ref, dtype)
        # gated float16: silu's exp may round an input differently from torch's (an ulp of x, not of y)
        bound = (2e-4 if gated and dtype == torch.float16 else 2e-7) * size + ulp
        torch_y = F.linear(x, w, b)  # the two-launch path on the CPU
        tickets = split_k._TICKETS.get(x.device)
        results[name] = {
            "dtype": str(y.dtype), "shape": list(y.shape),
            "worst_over_bound": float((err / bound).max()),
            "vs_torch_max_ulps": float(((y.double() - torch_y.double()).abs() / ulp).max())
            if dtype == torch.float16 and not gated else 0.0,
            "vs_torch_rel": float((y.double() - torch_y.double()).abs().max() / ref.abs().max()),
            "same_bits_twice": bool(torch.equal(y, again)),
            "tickets_zero": tickets is None or int(tickets.abs().sum()) == 0,
        }
    # A 3-D input (a [T, 1, K] view) and a non-contiguous one go through the same kernel.
    x3 = torch.randn(2, 1, 256)
    w3 = torch.randn(48, 256) * 0.05
    results["three_d"] = {"max_abs": float((kernel.dense_gemv(x3, w3, None, (8, 256, 1, 2))
                                             - F.linear(x3, w3)).abs().max())}
    xs = torch.randn(256, 3).T  # stride (1, 3): copied to contiguous rows first
    results["strided"] = {"max_abs": float((kernel.dense_gemv(xs, w3, None, (8, 64, 1, 1))
                                            - F.linear(xs, w3)).abs().max())}
    _run_fp8(results)
    return results


@functools.cache
def _results() -> dict[str, Any]:
    return dict(run_interpreted(__file__))


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gemv_equals_matmul(case: tuple[Any, ...]) -> None:
    name, m, n, _, dtype = case[:5]
    got = _results()[name]
    assert got["shape"] == [m, n] and got["dtype"] == f"torch.{dtype}"
    assert got["worst_over_bound"] <= 1.0, got
    assert got["vs_torch_max_ulps"] <= 1.0 and got["vs_torch_rel"] < (3e-3 if case[7] else 1e-3), got
    assert got["same_bits_twice"] and got["tickets_zero"], got


@needs_triton
@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_weights_with_row_scales(case: tuple[Any, ...]) -> None:
    name, m, n, _, dtype = case[:5]
    got = _results()[name]
    assert got["shape"] == [m, n] and got["dtype"] == f"torch.{dtype}"
    assert got["worst_over_bound"] <= 1.0 and got["same_bits_twice"], got


@needs_triton
def test_fp8_method_routes_decode_rows_through_the_gemv() -> None:
    # Both paths multiply the same e4m3 values by the same row scales; they differ by summation order and the
    # CPU path's rounding of the dequantized weight to float16 (2^-11 relative).
    assert _results()["fp8_method_route"]["max_rel"] < 2e-3


def test_fp8_weights_take_the_rule_on_gpus_that_convert_fp8() -> None:
    from pagedllm.layers import dense_gemv

    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    w = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    assert dense_gemv.gemv_blocks(x, w, None) is None  # a CPU tensor: the method's own path
    # 1-byte weights need twice the tile for the same bytes in flight (NOTE 4): the 8B's o projection at one row
    one, two = (dense_gemv.default_blocks(1, 4096, 4096, 132, element_bytes=e) for e in (1, 2))
    bytes_in_flight = [dense_gemv.in_flight_bytes(-(-4096 // b.block_n) * b.split_k, 132, b.num_warps,
                                                  b.block_n * b.block_k * e) for b, e in ((one, 1), (two, 2))]
    assert min(bytes_in_flight) >= dense_gemv.IN_FLIGHT_BYTES and one != two, (one, two)
    # The H200 grid's fastest one-row FP8 blocks, or within 1 % of them (examples/gpu/fp8_gemm_check.py --explore,
    # 2026-12-02 17:12 UTC): each thread's row slice is 16 e4m3 values
    swept = {(6144, 4096): (4, 1024, 2, 1), (4096, 4096): (4, 2048, 4, 1), (28672, 4096): (8, 1024, 2, 1),
             (4096, 14336): (4, 2048, 4, 1)}
    assert {nk: tuple(dense_gemv.default_blocks(1, *nk, 132, element_bytes=1)) for nk in swept} == swept


@needs_triton
def test_gemv_takes_views() -> None:
    got = _results()
    assert got["three_d"]["max_abs"] < 1e-5 and got["strided"]["max_abs"] < 1e-5, got


def test_rule_keeps_cpu_and_large_batches_on_torch() -> None:
    """On the CPU, for 32-bit or big batches, or with the switch off, dense_linear is F.linear bit for bit."""
    import torch.nn.functional as F

    from pagedllm.layers.dense_gemv import GEMV_TABLE, dense_linear, gemv_blocks

    x = torch.randn(1, 64, dtype=torch.float16)
    w = torch.randn(32, 64, dtype=torch.float16)
    assert gemv_blocks(x, w, None) is None  # a CPU tensor
    assert torch.equal(dense_linear(x, w, None, True), F.linear(x, w))
    assert torch.equal(dense_linear(x.float(), w.float(), None, False), F.linear(x.float(), w.float()))
    assert GEMV_TABLE == {} or all(k[0] <= 4 for k in GEMV_TABLE)


def test_folded_down_leaves_cpu_to_the_two_launch_path() -> None:
    from types import SimpleNamespace

    from pagedllm.layers.activation import SiluAndMul, fused_act_down
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.plugins.quantization.unquantized.method import UnquantizedConfig
    from pagedllm.protocols.model import ModelBuildContext

    ctx = ModelBuildContext(SimpleNamespace(), torch.float16, torch.device("cpu"), None, None, 16, 0, 1,
                            dense_config=UnquantizedConfig(dense_gemv=True))
    down = ReplicatedLinear(ctx, 16, 8)
    assert cast(Any, down.quant_method).dense_gemv
    act = SiluAndMul()
    gate_up = torch.randn(1, 32, dtype=torch.float16)
    assert fused_act_down(act, down, gate_up) is None  # the A/B switch off (the default: it lost on the H200)
    act.fold_into_gemv = True
    assert fused_act_down(act, down, gate_up) is None  # a CPU tensor


def test_default_blocks_fill_the_gpu() -> None:
    """The default split brings each Llama-8B shape to >= ~4 programs per SM, one step per split at least."""
    from pagedllm.layers.dense_gemv import default_blocks

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        for m in (1, 2, 4):
            bn, bk, warps, split = default_blocks(m, n, k, 132)
            assert bk == 8 * 32 * warps and k % bk == 0 and n % bn == 0  # NOTE 1 layout, unmasked loads
            steps = k // bk
            assert 1 <= split <= steps
            assert -(-n // bn) * split >= 4 * 132 or split == steps
    assert default_blocks(1, 100, 40) == (4, 64, 1, 1)  # a tiny K: one narrow step


# The H200 sweep's fastest blocks per linear at M = 1 (examples/gpu/small_gemv_check.py --explore, 2026-12-02,
# bf16, 24-point grid) where the rule must land, and Llama-8B's gemv_sweep.py choices of 2026-11-29.
SWEPT = {
    (3072, 2048): (4, 1024, 4, 1), (2048, 2048): (4, 2048, 8, 1),  # 1B o: 4.08 us, grid best 4.04
    (2048, 8192): (4, 2048, 8, 1), (6144, 2560): (4, 512, 2, 1), (2560, 4096): (4, 2048, 8, 1),
    (19456, 2560): (8, 512, 2, 1), (2560, 9728): (4, 512, 2, 4), (151936, 2560): (4, 512, 2, 1),
    (16384, 2048): (4, 1024, 4, 1), (128256, 2048): (4, 1024, 4, 1),  # within 2 % / 0.1 % of the grid's best
    (6144, 4096): (4, 1024, 4, 1), (4096, 4096): (4, 1024, 4, 1), (28672, 4096): (4, 2048, 8, 1),
    (4096, 14336): (4, 1024, 4, 1),
}


def test_single_row_rule_lands_on_the_swept_blocks() -> None:
    from pagedllm.layers.dense_gemv import GEMV_TABLE, choose_blocks

    for (n, k), want in SWEPT.items():
        assert tuple(choose_blocks(1, n, k, 132)) == want, (n, k)
    assert GEMV_TABLE[(1, 128256, 4096)] == (16, 1024, 4, 1)  # the 8B head stays pinned


def test_single_row_rule_fills_the_sms_or_splits_k() -> None:
    """Fewer SMs ask for more bytes in flight from each: a 2048-row down projection splits K on a 32-SM part,
    and every choice keeps NOTE 1's layout (BLOCK_K = 8 x 32 x warps) with unmasked loads where it can."""
    from pagedllm.layers import dense_gemv as rule

    for sms in (16, 32, 78, 132, 144):
        for n, k in ((2048, 2048), (2048, 8192), (2560, 9728), (16384, 2048), (151936, 2560), (1000, 3000)):
            bn, bk, warps, split = rule.single_row_blocks(n, k, sms)
            assert bk == 8 * 32 * warps and (k % bk == 0 or k % 512 != 0)
            programs = -(-n // bn) * split
            filled = rule.in_flight_bytes(programs, sms, warps, 2 * bn * bk) >= rule.IN_FLIGHT_BYTES
            assert filled or split == -(-k // bk), (sms, n, k, (bn, bk, warps, split))
    assert rule.single_row_blocks(2048, 8192, 16).split_k == 1  # 16 SMs: one program each is plenty
    assert rule.single_row_blocks(2560, 9728, 264).split_k == 7  # twice the SMs: 8 asked, 19 steps -> 7 x 3


def test_switch_reaches_linears_and_head_at_construction() -> None:
    """The dense config's switch reaches every dense linear's method and the dense LM head when they are built
    (ModelBuildContext.dense_config); a context without one gets torch's plain matmul."""
    from types import SimpleNamespace

    from pagedllm.layers.dense import DenseLinearMethod
    from pagedllm.layers.embedding import ParallelLMHead
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.plugins.quantization.unquantized.method import UnquantizedConfig, UnquantizedLinearMethod
    from pagedllm.protocols.model import ModelBuildContext

    def build(dense_config: Any) -> Any:
        ctx = ModelBuildContext(SimpleNamespace(), torch.float32, torch.device("cpu"), None, None, 16, 0, 1,
                                dense_config=dense_config)
        return torch.nn.ModuleDict({"a": ReplicatedLinear(ctx, 8, 8), "head": ParallelLMHead(ctx, 10, 8)})

    on, off, plain = build(UnquantizedConfig(dense_gemv=True)), build(UnquantizedConfig()), build(None)
    assert cast(Any, on["a"]).quant_method.dense_gemv and cast(Any, on["head"]).dense_method.dense_gemv
    assert not cast(Any, off["a"]).quant_method.dense_gemv and not cast(Any, off["head"]).dense_method.dense_gemv
    assert isinstance(cast(Any, on["head"]).dense_method, UnquantizedLinearMethod)
    assert type(cast(Any, plain["a"]).quant_method) is DenseLinearMethod


def test_config_switch() -> None:
    from pagedllm.config import EngineConfig

    assert EngineConfig.from_dict({}, env={"PAGEDLLM_DENSE_GEMV": "true"}).dense_gemv is True
    assert EngineConfig.from_dict({"dense_gemv": True}, env={"PAGEDLLM_DENSE_GEMV": "false"}).dense_gemv is False


@needs_triton
def test_compiles_for_sm90() -> None:
    """The kernel through Triton's compiler for sm_90 (offline: no GPU): M = 1 and 4, bf16 / fp16, direct and
    split, masked and not, with and without a bias, gated, with and without PDL, e4m3 weights with row scales."""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.layers import dense_gemv_kernel as t\n"
        "fn = t._dense_gemv_kernel\n"
        "for rows, bn, bk, warps, even, bias, fused, gated, dt, pdl, fp8 in (\n"
        "        (1, 8, 1024, 4, True, False, False, False, 'bf16', True, False),\n"
        "        (1, 8, 1024, 4, True, False, True, True, 'bf16', False, False),\n"
        "        (4, 2, 1024, 4, False, True, True, False, 'fp16', True, False),\n"
        "        (1, 16, 1024, 4, True, False, True, False, 'bf16', False, True),\n"
        "        (3, 2, 512, 2, False, True, False, False, 'bf16', False, True)):\n"
        "    cons = dict(ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, EVEN=even, HAS_BIAS=bias, ROW_SCALE=fp8,\n"
        "                FUSED_SPLIT=fused, GATED=gated, PDL=pdl)\n"
        "    ptrs = {'part_ptr': '*fp32', 'ticket_ptr': '*i32', 's_ptr': '*fp32'}\n"
        "    if fp8:  # e4m3 weights, widened in registers (NOTE 7)\n"
        "        ptrs['w_ptr'] = '*fp8e4nv'\n"
        "    sig = {a: 'constexpr' if a in cons else ptrs.get(a, '*' + dt) if a.endswith('_ptr') else 'i32'\n"
        "           for a in fn.arg_names}\n"
        "    keys = {(fn.arg_names.index(k),): val for k, val in cons.items()}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys),\n"
        "                       target=GPUTarget('cuda', 90, 32), options={'num_warps': warps})\n"
        "    ptx = k.asm['ptx']  # PDL (layers/pdl.py): the L2 prefetch, then the wait, only when asked for\n"
        "    assert ('griddepcontrol.wait' in ptx) == pdl and ('prefetch.global.L2' in ptx) == pdl\n"
        "    if pdl:\n"
        "        assert ptx.index('prefetch.global.L2') < ptx.index('griddepcontrol.wait') < ptx.index('ld.global')\n"
        "print('ok')\n"
    )
    compile_offline(code)


if __name__ == "__main__":
    print(json.dumps(_run()))
