"""W4A16 decode GEMV on tensor cores (w4a16_mma.cu), for M <= 8 activation rows of GPTQ-ordered 4-bit weights.

The Triton GEMVs (w4a16/gemv.py, w4a16/gemv_tiled.py) spend one FP32 FMA per code and activation row plus the
unpacking (3.44 SASS instructions per code for the best of them, `mant`). Here a code pair comes out of a
shifted word in one LOP3 and goes straight into an mma.m16n8k16 fragment, whose eight columns take up to eight
activation rows at nearly the cost of one; the zero point and the scale are applied to the fp32 sums once per
group. Triton cannot place values in mma fragments, so this one kernel is CUDA C, compiled at first use by
NVRTC (pagedllm.layers.cuda_rtc). The weights stay in the checkpoint's GPTQ order: no repacking (w4a16_mma.cu
NOTE 1). `gated=True` takes a fused [gate | up] layer and writes silu(gate) * up (w4a16_mma.cu NOTE 5).

    grid (N / (16 cols), splits)   block: WARPS warps, 16 cols outputs, WARPS x ITERS iterations of 32 inputs
    warp                           ITERS iterations; each: two (4 x cols)-byte word loads + one 16-byte load of
                                   x per lane, 2 cols + 2 mma
    block -> y                     warps summed in shared memory; splits > 1: float32 partials + a ticket per
                                   column block, the last block sums them in order (deterministic, graph safe)

Measured on the H200 (docs/benchmarks.md, tenth pass; perf-notes §16): 43.3 µs per 8B layer at M = 1 against
the Triton GEMV's 53.5 and bf16 cuBLAS's 116.9; GPTQ / AWQ single stream 2.33 ms per token, 1.83x bf16. What
moved it from the ninth pass's 51.4: the math of a run is as long as its loads (probes: gate_up 15.7 µs of math
alone, 14.8 of loads alone, 23.4 both), so the loop lost instructions (500 -> 444 per run: a constant group,
shifted-word pairs, running pointers). Bytes in flight through L2 prefetches or a cp.async ring did not help.

NOTE 1 (sizes): the swept blocks for the Llama-3.1-8B shapes, else ITERS picked so that about 16 warps per SM
stream at once (132 SMs); UNROLL (iterations whose loads are in flight together) divides the group's
iterations, so a group's zero points and scales are loaded once per UNROLL run. `blocks=` overrides, and
$PAGEDLLM_W4A16_MMA (pdl, cols, zfold, dq, gated; probe for measurements) changes the defaults for A/B runs
(examples/gpu/w4_mma_check.py sweeps).
NOTE 2 (when it runs): CUDA devices of compute capability >= 8.0 (mma.sync bf16), 4-bit GPTQ order (AWQ is
repacked into it at load), N, K and the group a multiple of 32, 16-bit activations with scales of the same
dtype, NVRTC found; `mma_reason` says why not, and w4a16_gemv falls back to the Triton GEMVs.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

logger = logging.getLogger(__name__)

MMA_MAX_M = 8  # the mma's eight B columns
_SMS = 132
_TARGET_WARPS = _SMS * 16


class MmaBlocks(NamedTuple):
    warps: int  # per block
    iters: int  # iterations of 32 inputs per warp (a multiple of unroll)
    unroll: int  # iterations whose loads are issued together (divides the group's iterations)
    cols: int = 4  # 4 or 2 columns per lane: a block owns 16 * cols outputs (w4a16_mma.cu NOTE 1)
    zfold: int = 1  # 1: the zero point subtracted after the mma (w4a16_mma.cu NOTE 2)
    pdl: int = 0  # 1: programmatic dependent launch (w4a16_mma.cu NOTE 4; sm_90+)
    dq: int = 1  # code pairs: 0 PRMT + LOP3 each, 1 LOP3 on shifted words (w4a16_mma.cu NOTE 2)
    probe: int = 0  # measurement only (w4a16_mma.cu): 1 the loads without the math, 2 the math without the loads


@functools.cache
def cuda_source(name: str) -> str:
    """The CUDA source `name` of this package after w4a16_fragments.cuh, the helpers both tensor-core kernels
    use (NVRTC compiles one string: no include path)."""
    here = Path(__file__).parent
    return (here / "w4a16_fragments.cuh").read_text() + "\n" + (here / name).read_text()


def _source() -> str:
    return cuda_source("w4a16_mma.cu")


def _unroll(layout: PackedLayout, k: int) -> int:
    group_iters = layout.group_size // 32
    return next(u for u in (4, 2, 1) if group_iters % u == 0 and (k // 32) % u == 0)


# (N, K) -> (warps, iters, unroll[, cols, zfold]) at M = 1: the H200 sweep's best per Llama-3.1-8B shape (group
# 128, DQ 1, running pointers; `python examples/gpu/w4_mma_check.py`, 2026-11-30 08:28 UTC, docs/benchmarks.md).
# Other shapes: the rule.
_SWEPT: dict[tuple[int, int], tuple[int, ...]] = {
    (6144, 4096): (4, 8, 4), (4096, 4096): (8, 4, 4), (28672, 4096): (4, 32, 4), (4096, 14336): (4, 16, 4)}


@functools.cache
def mma_blocks(layout: PackedLayout, m: int, n: int, k: int, device: torch.device | None = None) -> MmaBlocks:
    """NOTE 1: the swept entry, else ITERS the power of two in [4, 64] nearest to ~16 warps per SM; PDL on
    sm_90+ unless $PAGEDLLM_W4A16_MMA says otherwise."""
    knobs = _env_knobs()
    pdl = knobs.get("pdl", int(device is not None and torch.cuda.get_device_capability(device) >= (9, 0)))
    swept = _SWEPT.get((n, k))
    if swept is not None and (layout.group_size // 32) % swept[2] == 0:
        return MmaBlocks(*swept)._replace(pdl=pdl)._replace(**_block_knobs(knobs))
    unroll = _unroll(layout, k)
    total_iters = k // 32
    cols = 4 if n % 64 == 0 else 2
    want = (n // (16 * cols)) * total_iters / _TARGET_WARPS
    iters = 4
    while iters < 64 and iters * 1.5 < want:
        iters *= 2
    iters = max(iters, unroll)
    return MmaBlocks(4, iters, unroll, cols, pdl=pdl)._replace(**_block_knobs(knobs))


def _block_knobs(knobs: dict[str, int]) -> dict[str, int]:
    return {name: v for name, v in knobs.items() if name not in ("pdl", "gated")}


@functools.cache
def _env_knobs() -> dict[str, int]:
    """$PAGEDLLM_W4A16_MMA, e.g. "pdl=0,cols=2,zfold=0": A/B runs on the GPU (NOTE 1)."""
    raw = os.environ.get("PAGEDLLM_W4A16_MMA", "")
    knobs = dict(item.split("=", 1) for item in raw.split(",") if item)
    unknown = sorted(set(knobs) - {"pdl", "cols", "zfold", "dq", "probe", "gated"})
    if unknown:
        raise ValueError(f"PAGEDLLM_W4A16_MMA: unknown knobs {unknown} (pdl, cols, zfold, dq, probe, gated)")
    return {k: int(v) for k, v in knobs.items()}


def mma_reason(layout: PackedLayout, x: torch.Tensor, scales: torch.Tensor, qweight: torch.Tensor, n: int) -> str | None:
    """Why the mma GEMV cannot take this product (None: it can); NOTE 2."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if layout.kind != "gptq" or layout.bits != 4:
        return f"{layout.bits}-bit {layout.kind} (4-bit GPTQ order only)"
    if not 0 < m <= MMA_MAX_M:
        return f"{m} rows (1..{MMA_MAX_M})"
    if x.dtype not in (torch.bfloat16, torch.float16) or scales.dtype != x.dtype:
        return f"activations {x.dtype} with scales {scales.dtype} (one 16-bit dtype)"
    if n % 32 or k % 32 or layout.group_size % 32:
        return f"N = {n}, K = {k}, group {layout.group_size} (multiples of 32)"
    return device_reason(x, scales, qweight, n)


def device_reason(x: torch.Tensor, scales: torch.Tensor, qweight: torch.Tensor, n: int) -> str | None:
    """What both tensor-core kernels (this GEMV, mma_gemm.py's GEMM) need of the tensors and the device."""
    if not (qweight.is_contiguous() and scales.is_contiguous() and qweight.shape[1] == n):
        return "qweight / scales not contiguous [*, N]"
    if not x.is_cuda or torch.version.hip:
        return "not a CUDA device"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "compute capability below 8.0 (no bf16 mma.sync)"
    return None


@functools.cache
def _kernel_or_error(device: torch.device, defines: tuple[tuple[str, int], ...]) -> object:
    from pagedllm.api.kernels import RtcError, load_kernel

    try:
        return load_kernel(_source(), "w4a16_mma_gemv", device, dict(defines))
    except (RtcError, OSError, RuntimeError) as exc:
        return exc


def kernel_error(device: torch.device, dtype: torch.dtype, blocks: MmaBlocks, group_iters: int,
                 gated: bool = False) -> Exception | None:
    """None when the kernel for these blocks and group compiles and loads on `device`, else why not (cached)."""
    got = _kernel_or_error(device, _defines(dtype, blocks, group_iters, gated))
    return got if isinstance(got, Exception) else None


def usable(layout: PackedLayout, x: torch.Tensor, scales: torch.Tensor, qweight: torch.Tensor, n: int,
           gated: bool = False) -> bool:
    """mma_reason (gated: gated_reason) is None and the default blocks' kernel compiled; a compile failure is
    logged once. `gated`: for the SiLU epilogue (w4a16_mma.cu NOTE 5); $PAGEDLLM_W4A16_MMA gated=0 says no."""
    if gated and not _env_knobs().get("gated", 1):
        return False
    if (gated_reason if gated else mma_reason)(layout, x, scales, qweight, n) is not None:
        return False
    k = x.shape[-1]
    blocks = _for_epilogue(mma_blocks(layout, x.numel() // k, n, k, x.device), gated)
    error = kernel_error(x.device, x.dtype, blocks, layout.group_size // 32, gated)
    if error is not None:
        _warn_once(str(error))
    return error is None


def _for_epilogue(blocks: MmaBlocks, gated: bool) -> MmaBlocks:
    """The gated kernel takes 4 columns per lane: a block holds 32 gate and 32 up columns (.cu NOTE 5)."""
    return blocks._replace(cols=4) if gated else blocks


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("w4a16 mma GEMV unavailable, the Triton GEMV runs instead: %s", message)


def _defines(dtype: torch.dtype, blocks: MmaBlocks, group_iters: int, gated: bool = False) -> tuple[tuple[str, int], ...]:
    return (("COLS", blocks.cols), ("DQ", blocks.dq), ("FP16", int(dtype == torch.float16)), ("GATED", int(gated)),
            ("GI", group_iters),
            ("ITERS", blocks.iters), ("PDL", blocks.pdl), ("PROBE", blocks.probe), ("UNROLL", blocks.unroll),
            ("WARPS", blocks.warps), ("ZFOLD", blocks.zfold))


def w4a16_mma_gemv(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    blocks: MmaBlocks | tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(layout, ...) in x's dtype; mma_reason(...) must be None. `out`: a
    contiguous [M, N] tensor of x's dtype to write instead of a new one. `gated`: the weights are [gate | up]
    and y [..., N / 2] = silu(gate) * up (w4a16_mma.cu NOTE 5; usable(..., gated=True) must hold)."""
    from pagedllm.api.kernels import launch_rtc as launch
    from pagedllm.api.kernels import tickets

    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1 or flat.stride(0) % 8 or flat.data_ptr() % 16:
        flat = flat.clone(memory_format=torch.contiguous_format)  # 16-byte aligned rows for the uint4 loads
    m = flat.shape[0]
    b = _for_epilogue(MmaBlocks(*blocks) if blocks is not None else mma_blocks(layout, m, n, k, x.device), gated)
    assert b.iters % b.unroll == 0 and (layout.group_size // 32) % b.unroll == 0, b
    assert n % (16 * b.cols) == 0, (n, b)
    kernel = _kernel_or_error(x.device, _defines(x.dtype, b, layout.group_size // 32, gated))
    if isinstance(kernel, Exception):
        raise kernel
    total_iters = k // 32
    splits = -(-total_iters // (b.warps * b.iters))
    col_blocks = n // (16 * b.cols)
    n_out = n // 2 if gated else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n_out) and y.is_contiguous() and y.dtype == x.dtype, (tuple(y.shape), m, n_out)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    ticket_buf = tickets(x.device, col_blocks) if splits > 1 else y
    launch(kernel, (col_blocks, splits, 1), (b.warps * 32, 1, 1),
           [flat, qweight, qzeros, scales, y, part, ticket_buf, m, n, flat.stride(0), qzeros.stride(0),
            scales.stride(0), total_iters, layout.zero_offset], pdl=bool(b.pdl))
    return y.reshape(*x.shape[:-1], n_out)


def gated_reason(layout: PackedLayout, x: torch.Tensor, scales: torch.Tensor, qweight: torch.Tensor, n: int) -> str | None:
    """Why the GEMV cannot form silu(gate) * up of these [gate | up] weights itself (None: it can)."""
    if n % 64:
        return f"N = {n} (each half a multiple of 32 columns: blocks of 4 columns per lane)"
    return mma_reason(layout, x, scales, qweight, n)


def w4a16_mma_rows(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    n: int,
) -> torch.Tensor:
    """w4a16_mma_gemv over any number of rows, MMA_MAX_M at a time, into one output (w4a16/kernel.py NOTE 5 sends
    9..16 rows here: each launch costs about what one row does)."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    y = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    for r0 in range(0, flat.shape[0], MMA_MAX_M):
        w4a16_mma_gemv(flat[r0 : r0 + MMA_MAX_M], layout, qweight, qzeros, scales, n, out=y[r0 : r0 + MMA_MAX_M])
    return y.reshape(*x.shape[:-1], n)

