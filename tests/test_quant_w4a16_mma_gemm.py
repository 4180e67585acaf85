"""The tensor-core W4A16 GEMM (plugins/quantization/w4a16/mma_gemm.py): what the CPU can check.

The kernel runs only on a GPU (examples/gpu/w4_mma_gemm_check.py checks it against the dequantized weights on
the H200: 182 cases, every tile shape and split). Here: its CUDA source compiles with NVRTC for sm_80 and
sm_90a for every tile shape the host can ask for, with no local-memory spills and the mma / dequantization
instruction counts of one k-tile that w4a16_mma_gemm.cu NOTE 1-2 describe; the host's refusals, shared memory
sizes and tile rule; and that w4a16_matmul falls back off CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_quant_w4a16_mma import _sass_ops

from pagedllm.plugins.quantization.w4a16 import mma_gemm
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

GPTQ = PackedLayout("gptq", 4, 128, 1)
TILES = [(2, 1, 4, 4), (2, 1, 8, 4), (1, 1, 8, 3), (2, 2, 8, 4), (2, 4, 4, 3), (1, 4, 4, 4)]


def _compile(arch: str, defines: dict[str, int]) -> bytes:
    from pagedllm.layers.cuda_rtc import RtcError, compile_cubin

    try:
        return compile_cubin(mma_gemm._source(), "w4a16_mma_gemm", arch, defines)
    except RtcError as exc:
        if "NVRTC not found" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("tiles", TILES)
def test_source_compiles_without_spills(arch: str, tiles: tuple[int, int, int, int], tmp_path) -> None:
    t = mma_gemm.GemmTiles(*tiles, 1)
    ops = _sass_ops(_compile(arch, dict(mma_gemm._defines(torch.bfloat16, t, 4))), tmp_path)
    assert ops["STL"] == 0 and ops["LDL"] == 0, "local memory: the accumulators or the fragments spilled"
    # One k-tile unrolled: 2 iterations x TM activation tiles x 4 weight tiles x 2 k-steps (NOTE 1).
    assert ops["HMMA"] == 16 * t.tm
    # NOTE 2: a word's four pairs are LOP3s of shifted words, each pair two FMA2s (q - z, then the scale): 16
    # words a k-tile per lane (HADD2 / HMUL2 for bf16); four PRMTs pair each activation load.
    assert ops["HADD2"] + ops["HFMA2"] + ops["HMUL2"] >= 128
    assert ops["PRMT"] >= 8 * t.tm
    assert ops["MUFU"] == 0 and ops["IABS"] == 0  # the group is a constant: no integer division in the loop


@pytest.mark.parametrize("fp16,gi", [(1, 4), (0, 2), (0, 64)])
def test_dtypes_and_groups_compile(fp16: int, gi: int, tmp_path) -> None:
    t = mma_gemm.GemmTiles(2, 1, 8, 4, 1)
    dtype = torch.float16 if fp16 else torch.bfloat16
    ops = _sass_ops(_compile("sm_90a", dict(mma_gemm._defines(dtype, t, gi))), tmp_path)
    assert ops["HMMA"] == 128 and ops["STL"] == 0


def test_refusals_name_the_reason() -> None:
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    s = torch.zeros(2, 192, dtype=torch.bfloat16)
    qw = torch.zeros(32, 192, dtype=torch.int32)
    assert "4-bit GPTQ" in mma_gemm.gemm_reason(PackedLayout("awq", 4, 128), x, s, qw, 192)
    assert "one 16-bit dtype" in mma_gemm.gemm_reason(GPTQ, x, s.float(), qw, 192)
    assert "multiples of 64" in mma_gemm.gemm_reason(PackedLayout("gptq", 4, 32, 1), x, s, qw, 192)
    assert "multiples of 64" in mma_gemm.gemm_reason(GPTQ, x, s[:, :160], qw[:, :160], 160)
    assert "not a CUDA device" in mma_gemm.gemm_reason(GPTQ, x, s, qw, 192)
    # one group per column (group_size -1) is a group of K: taken
    assert mma_gemm.gemm_reason(PackedLayout("gptq", 4, -1, 1), x, s[:1], qw, 192) == "not a CUDA device"


def test_shared_memory_and_tile_rule() -> None:
    # a stage: 8 word rows x BN, BM x 64 activations, BN scales, BN / 8 zero words, rounded to 128 bytes
    assert mma_gemm.GemmTiles(2, 1, 4, 4, 1).shared_bytes == 4 * (4096 + 4096 + 256 + 128)
    assert mma_gemm.GemmTiles(2, 1, 8, 4, 1).shared_bytes == 4 * (4096 + 8192 + 256 + 128)
    rule = {(m, n, k): tuple(mma_gemm.gemm_tiles(m, n, k, 132))[:5]
            for m in (64, 128) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}
    # NOTE 2 against the H200 sweep's best at 64 / 128 rows: qkv, o split 4 (>= 16 k-tiles a slice), down 8 / 4
    # at 32 rows a warp; gate_up (224 column blocks >= 132 SMs) 64 rows a warp
    assert rule[(64, 6144, 4096)] == rule[(64, 4096, 4096)] == (2, 1, 4, 4, 4)
    assert rule[(64, 4096, 14336)] == (2, 1, 4, 4, 8)
    assert rule[(128, 6144, 4096)] == rule[(128, 4096, 4096)] == rule[(128, 4096, 14336)] == (2, 1, 4, 4, 4)
    assert rule[(128, 28672, 4096)] == rule[(64, 28672, 4096)] == (2, 1, 8, 4, 1)
    assert mma_gemm.gemm_tiles(32, 28672, 4096, 132).tm == 4  # a 64-row tile would be half padding
    # a narrow layer (N not a multiple of 128) takes one warp along N; a short K is not split below 8 k-tiles
    assert mma_gemm.gemm_tiles(64, 192, 512, 132) == (1, 1, 4, 4, 1, 0)
    # fewer SMs: fewer blocks fit at once, so less splitting
    assert mma_gemm.gemm_tiles(128, 4096, 4096, 16).split == 1


def test_matmul_takes_the_gemm_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the GEMM usable (stubbed: no GPU here) w4a16_matmul sends it 17..64 rows, and 65..128 of a layer of
    >= 2^25 weights; where it is not usable the route below runs (test_quant_w4a16_dequant's dispatch test
    covers that off CUDA). Kernels are stubs: no launch."""
    from pagedllm.plugins.quantization.w4a16 import kernel as w4a16_kernel

    calls: list[str] = []
    for name in ("w4a16_gemv", "w4a16_gemm", "w4a16_dequant_matmul"):
        monkeypatch.setattr(w4a16_kernel, name, lambda *a, _n=name, **kw: calls.append(_n))
    monkeypatch.setattr(mma_gemm, "usable", lambda *a, **kw: True)
    monkeypatch.setattr(mma_gemm, "w4a16_mma_gemm", lambda *a, **kw: calls.append("mma_gemm"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(w4a16_kernel, "sm_count", lambda index: 132)
    for m, n, k in ((17, 64, 256), (64, 64, 256), (65, 64, 256), (128, 8192, 4096), (129, 8192, 4096)):
        w4a16_kernel.w4a16_matmul(torch.zeros(m, k), GPTQ, None, None, None, None, n)  # type: ignore[arg-type]
    assert calls == ["mma_gemm", "mma_gemm", "w4a16_dequant_matmul", "mma_gemm", "w4a16_dequant_matmul"]
