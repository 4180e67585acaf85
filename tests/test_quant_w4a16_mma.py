"""The tensor-core W4A16 GEMV (plugins/quantization/w4a16/mma.py): what the CPU can check.

The kernel itself runs only on a GPU (examples/gpu/w4_mma_check.py checks it against the dequantized weights on
the H200). Here: its CUDA source compiles with NVRTC for sm_80 and sm_90a in every variant the host can ask
for, with no local-memory spills and the mma count per loop the design says (w4a16_mma.cu NOTE 1, 2); the
host's refusals and block choice; and that the decode GEMV falls back to the Triton kernel off CUDA.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import subprocess

import pytest
import torch

from pagedllm.plugins.quantization.w4a16 import mma as mma
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

GPTQ = PackedLayout("gptq", 4, 128, 1)


def _nvdisasm() -> str | None:
    import triton

    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))
    return found[0] if found else None


def _sass_ops(cubin: bytes, tmp_path) -> collections.Counter[str]:
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("triton ships no nvdisasm here")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, check=True).stdout
    return collections.Counter(
        m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    )


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("fp16", [0, 1])
@pytest.mark.parametrize("cols,zfold,unroll,dq", [(4, 1, 4, 1), (4, 0, 2, 1), (2, 1, 2, 1), (2, 0, 1, 0), (4, 1, 4, 0)])
def test_source_compiles_unrolled_without_spills(arch: str, fp16: int, cols: int, zfold: int, unroll: int, dq: int,
                                                  tmp_path) -> None:
    from pagedllm.layers.cuda_rtc import RtcError, compile_cubin

    pdl = int(arch == "sm_90a")  # griddepcontrol needs sm_90
    defines = dict(COLS=cols, DQ=dq, FP16=fp16, GI=4, ITERS=8, PDL=pdl, UNROLL=unroll, WARPS=4, ZFOLD=zfold)
    try:
        cubin = compile_cubin(mma._source(), "w4a16_mma_gemv", arch, defines)
    except RtcError as exc:
        if "NVRTC not found" in str(exc):
            pytest.skip(str(exc))
        raise
    ops = _sass_ops(cubin, tmp_path)
    assert ops["STL"] == 0 and ops["LDL"] == 0, "local memory: the accumulators or the batch spilled"
    # One loop body: two tiles per column and iteration, plus ZFOLD's two of ones per iteration (NOTE 2).
    assert ops["HMMA"] == unroll * (2 * cols + 2 * zfold)
    # A group of 4 iterations is a constant (GI): no integer division in the loop.
    assert ops["MUFU"] == 0 and ops["IABS"] == 0
    pairs = unroll * cols * 8
    if dq:  # NOTE 2, DQ 1: LOP3 per pair on the word shifted by 0, 4, 8, 12; four PRMTs pair the activations
        assert ops["PRMT"] == 4 * unroll
        assert ops["LOP3"] >= pairs and ops["SHF"] >= 3 * pairs // 4
    else:  # one PRMT and one LOP3 per pair
        assert ops["PRMT"] == pairs
    # ZFOLD drops the zero-point FMA2 (HADD2 / HFMA2 class; a few stay as float16 -> float32 scale conversions).
    halves = ops["HADD2"] + ops["HFMA2"]
    assert (halves < pairs // 2) if zfold else (halves >= pairs)


def test_refusals_name_the_reason() -> None:
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    s = torch.zeros(2, 192, dtype=torch.bfloat16)
    qw = torch.zeros(32, 192, dtype=torch.int32)
    assert mma.mma_reason(PackedLayout("gptq", 8, 128, 1), x, s, qw, 192).startswith("8-bit gptq")
    assert mma.mma_reason(GPTQ, torch.zeros(9, 256, dtype=torch.bfloat16), s, qw, 192) == "9 rows (1..8)"
    assert "one 16-bit dtype" in mma.mma_reason(GPTQ, x, s.half(), qw, 192)  # type: ignore[operator]
    assert "multiples of 32" in mma.mma_reason(GPTQ, x, s[:, :176], qw[:, :176], 176)  # type: ignore[operator]
    assert "contiguous" in mma.mma_reason(GPTQ, x, s, qw.t().contiguous().t(), 192)  # type: ignore[operator]
    assert mma.mma_reason(GPTQ, x, s, qw, 192) == "not a CUDA device"
    assert not mma.usable(GPTQ, x, s, qw, 192)


def test_blocks_follow_the_sweep_and_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    for (n, k), swept in mma._SWEPT.items():
        assert mma.mma_blocks(GPTQ, 1, n, k)[: len(swept)] == swept
    for n, k, group in [(192, 256, 128), (11008, 4096, 128), (4096, 11008, 64), (96, 4096, 32), (4096, 4096, -1)]:
        layout = PackedLayout("gptq", 4, group if group > 0 else k, 0)
        b = mma.mma_blocks(layout, 1, n, k)
        assert (layout.group_size // 32) % b.unroll == 0 and b.iters % b.unroll == 0 and (k // 32) % b.unroll == 0
        assert 4 <= b.iters <= 64 and b.cols == (4 if n % 64 == 0 else 2) and b.pdl == 0  # no device: no PDL
    mma.mma_blocks.cache_clear()
    mma._env_knobs.cache_clear()
    monkeypatch.setenv("PAGEDLLM_W4A16_MMA", "cols=2,zfold=0")
    try:
        assert mma.mma_blocks(GPTQ, 1, 4096, 4096)[3:5] == (2, 0)
        mma._env_knobs.cache_clear()
        monkeypatch.setenv("PAGEDLLM_W4A16_MMA", "bogus=1")
        with pytest.raises(ValueError, match="bogus"):
            mma._env_knobs()
    finally:
        mma.mma_blocks.cache_clear()
        mma._env_knobs.cache_clear()


def test_decode_gemv_defaults_to_mma_and_refuses_unknown_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.plugins.quantization.w4a16 import gemv as w4a16_gemv

    assert w4a16_gemv.gemv_variant() == "mma"
    monkeypatch.setenv("PAGEDLLM_W4A16_GEMV", "nope")
    with pytest.raises(ValueError, match="PAGEDLLM_W4A16_GEMV"):
        w4a16_gemv.gemv_variant()


def test_gate_up_hook_reaches_the_method_and_declines_cleanly() -> None:
    from torch import nn

    from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul, fused_gate_up_act
    from pagedllm.plugins.quantization.w4a16.method import PackedIntLinearMethod

    calls: list[str] = []

    class Method:
        def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
            calls.append(activation)
            return x[..., :2] * 3 if activation == "silu" else None

    layer = nn.Module()
    layer.quant_method = Method()  # type: ignore[assignment]
    x = torch.ones(1, 4)
    assert torch.equal(fused_gate_up_act(layer, SiluAndMul(), x), x[..., :2] * 3)  # type: ignore[arg-type]
    assert fused_gate_up_act(layer, GeluTanhAndMul(), x) is None
    assert calls == ["silu", "gelu_tanh"]
    assert fused_gate_up_act(layer, nn.ReLU(), x) is None  # not a gated activation: the hook is not asked
    assert calls == ["silu", "gelu_tanh"]
    plain = nn.Module()
    plain.quant_method = object()  # type: ignore[assignment]
    assert fused_gate_up_act(plain, SiluAndMul(), x) is None  # a method without the hook
    # The W4A16 method declines off CUDA (its kernel is the tensor-core GEMV): the MLP runs gate_up, then SiLU.
    assert PackedIntLinearMethod(GPTQ).apply_act_and_mul(nn.Module(), x, "silu") is None


@pytest.mark.parametrize("gated", [False, True])
def test_launch_arguments_match_the_kernel_signature(monkeypatch: pytest.MonkeyPatch, gated: bool) -> None:
    """The host passes exactly the kernel's parameters (a driver launch cannot check them), and the grid and
    the output shape follow the blocks: N / 64 column blocks, K / (warps x iters x 32) splits, [M, N or N / 2]."""
    import pagedllm.api.kernels as rtc  # the plugin launches through the API's launch_rtc

    params = re.search(r"w4a16_mma_gemv\(([^)]*)\)", mma._source())
    assert params is not None
    got: dict[str, object] = {}
    monkeypatch.setattr(mma, "_kernel_or_error", lambda device, defines: ("kernel", dict(defines)))
    monkeypatch.setattr(rtc, "launch_rtc", lambda kernel, grid, block, args, pdl=False: got.update(
        kernel=kernel, grid=grid, block=block, args=args))
    x = torch.zeros(2, 512, dtype=torch.bfloat16)
    qw = torch.zeros(64, 256, dtype=torch.int32)
    y = mma.w4a16_mma_gemv(x, GPTQ, qw, torch.zeros(4, 32, dtype=torch.int32), torch.zeros(4, 256, dtype=torch.bfloat16),
                           256, blocks=mma.MmaBlocks(4, 2, 2), gated=gated)
    assert len(got["args"]) == len(params.group(1).split(","))  # type: ignore[arg-type]
    assert got["grid"] == (256 // 64, 512 // (4 * 2 * 32), 1) and got["block"] == (128, 1, 1)
    assert tuple(y.shape) == (2, 128 if gated else 256)
    assert got["kernel"][1]["GATED"] == int(gated) and got["kernel"][1]["GI"] == 4  # type: ignore[index]
