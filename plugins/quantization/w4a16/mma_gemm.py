"""W4A16 GEMM on tensor cores (w4a16_mma_gemm.cu) for tens to thousands of activation rows of GPTQ-ordered 4-bit
weights, the dequantized tile never leaving registers.

Between the decode GEMV's few rows and a long prefill the W4A16 method had two choices, both losing to bf16
cuBLAS: Triton's tl.dot with a register-built weight operand (the unpacking competes with the dot: 1.1-2.4x
dequantize + cuBLAS at >= 256 rows, examples/gpu/w4_gemm_probe.py), and dequantizing every weight into a
16-bit scratch for cuBLAS (w4a16/dequant.py: per 8B layer 325 us at 256 rows against bf16's 181, the scratch
written and read once per call). This kernel builds the mma fragments itself, as the decode GEMV does
(w4a16/mma.py), but streams both operands through a multi-stage cp.async ring in shared memory and keeps
every dequantized weight pair for 8 TM activation rows' mma (TM = 8: 64 rows a warp), so the 15 instructions a
word cost (w4a16_mma_gemm.cu NOTE 2) are spread over 8 TM mma. The weights stay in the checkpoint's GPTQ
order (NOTE 1 there); AWQ is repacked into it at load, as for the GEMV.

    grid (row blocks, column blocks, splits)   block: WN x WM warps, BN = 64 WN columns x BM = 8 TM WM rows
    k-tile (64 inputs)                         one cp.async group: 8 word rows, BM x 64 activations, the
                                               group's scales and zero words; STAGES of them in flight
    warp, per k-tile                           4 x 16-byte word loads -> 32 A registers (two 32-input steps),
                                               TM x 2 16-byte activation loads -> 4 B registers each, 64 TM mma
    split > 1                                  float32 partials + a ticket per tile; the last block sums them
                                               in split order (deterministic, graph safe)

NOTE 1 (when it runs): CUDA devices of compute capability >= 8.0, 4-bit GPTQ order without act-order, a group
of 64, 128, ... inputs or one per column (a 64-input k-tile inside one group), N a multiple of 64, K of 64,
16-bit activations with scales of that dtype, NVRTC found; `gemm_reason` says why not and w4a16_matmul keeps
its other routes.
NOTE 2 (tiles): small blocks won the H200 sweep (examples/gpu/w4_mma_gemm_check.py, 2026-12-03, 8B layers at
16-2048 rows): two warps (128 columns x 32 or 64 rows), four stages, several blocks resident per SM. A layer of
at least SMs column blocks (gate_up) takes 64 rows a warp past 32 rows (at 32 rows a 64-row tile is half
padding: 62.6 against 39.0 us) and no split (64 rows: 58.6 us unsplit, 65.8 split in two); narrower ones 32
rows, for twice the row blocks, with K split by powers of two (<= 8, >= 16 k-tiles a slice: on K = 4096 split
4 beat 8 at 32-64 rows, 16.8 against 19.1 us for qkv at 32) while the grid still fits the blocks the SMs hold at
once (shared memory bounds them: 6 of 32 rows). On every 8B layer at 32-128 rows this rule's tiles came within
5 % of the third sweep's best, but for gate_up at 64 rows (split 2 there: 65.6 against the rule's 68.9).
ZFOLD 1 (w4a16_mma_gemm.cu NOTE 5) lost on every layer (5-10 %; W2 at 64 sequences 0.98x): the mma pipe,
not the issue of the dequantizing instructions, bounds the kernel, and ZFOLD adds a quarter more mma.
$PAGEDLLM_W4A16_GEMM (wn, wm, tm, stages, split, zfold) overrides fields for A/B runs.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch

from pagedllm.plugins.quantization.w4a16.layout import PackedLayout
from pagedllm.plugins.quantization.w4a16.mma import cuda_source, device_reason

logger = logging.getLogger(__name__)

K_TILE = 64
_SMS = 132


class GemmTiles(NamedTuple):
    wn: int  # warps along the output columns: 64 wn columns a block
    wm: int  # warps along the activation rows (1, 2 or 4)
    tm: int  # 8-row activation tiles per warp (4 or 8): 8 tm wm rows a block
    stages: int  # k-tiles in flight
    split: int  # slices of K (NOTE 2)
    zfold: int = 0  # 1: zero point and scale on the float32 sums per group (w4a16_mma_gemm.cu NOTE 5; tm 4 only)

    @property
    def block_m(self) -> int:
        return 8 * self.tm * self.wm

    @property
    def block_n(self) -> int:
        return 64 * self.wn

    @property
    def shared_bytes(self) -> int:
        stage = 32 * self.block_n + 128 * self.block_m + 2 * self.block_n + self.block_n // 2
        return self.stages * (-(-stage // 128) * 128)


def _source() -> str:
    return cuda_source("w4a16_mma_gemm.cu")


def gemm_reason(layout: PackedLayout, x: torch.Tensor, scales: torch.Tensor, qweight: torch.Tensor, n: int
                ) -> str | None:
    """Why the tensor-core GEMM cannot take this product (None: it can); NOTE 1."""
    k = x.shape[-1]
    group = _group_of(layout, k)
    if layout.kind != "gptq" or layout.bits != 4:
        return f"{layout.bits}-bit {layout.kind} (4-bit GPTQ order only)"
    if x.dtype not in (torch.bfloat16, torch.float16) or scales.dtype != x.dtype:
        return f"activations {x.dtype} with scales {scales.dtype} (one 16-bit dtype)"
    if n % 64 or k % K_TILE or group % K_TILE or k % group:
        return f"N = {n}, K = {k}, group {group} (N, K and the group multiples of 64)"
    return device_reason(x, scales, qweight, n)


_SHARED_PER_SM = 227 * 1024  # an H100 / H200 SM's shared memory for blocks


@functools.cache
def gemm_tiles(m: int, n: int, k: int, sms: int = _SMS) -> GemmTiles:
    """NOTE 2: two warps a block (one along M); 64 rows a warp past 32 rows on a layer of at least SMs column
    blocks, else 32 (more row blocks), split by powers of two while the grid still fits the resident blocks."""
    wn = 2 if n % 128 == 0 else 1
    tm = 8 if m > 32 and n // (64 * wn) >= sms else 4
    tiles = GemmTiles(wn, 1, tm, 4, 1)
    blocks = -(-m // tiles.block_m) * (n // tiles.block_n)
    slots = sms * min(8, _SHARED_PER_SM // tiles.shared_bytes)
    k_tiles = k // K_TILE
    split = 1
    while tm == 4 and split < 8 and blocks * split * 2 <= slots and k_tiles // (2 * split) >= 16:
        split *= 2
    knobs = _env_knobs()
    return tiles._replace(split=split, **{f: v for f, v in knobs.items() if f != "zfold" or knobs.get("tm", tm) == 4})


@functools.cache
def _env_knobs() -> dict[str, int]:
    """$PAGEDLLM_W4A16_GEMM, e.g. "tm=4,split=2": A/B runs on the GPU (NOTE 2)."""
    raw = os.environ.get("PAGEDLLM_W4A16_GEMM", "")
    knobs = dict(item.split("=", 1) for item in raw.split(",") if item)
    unknown = sorted(set(knobs) - set(GemmTiles._fields))
    if unknown:
        raise ValueError(f"PAGEDLLM_W4A16_GEMM: unknown knobs {unknown} ({', '.join(GemmTiles._fields)})")
    return {name: int(v) for name, v in knobs.items()}


def _defines(dtype: torch.dtype, tiles: GemmTiles, group_iters: int) -> tuple[tuple[str, int], ...]:
    return (("FP16", int(dtype == torch.float16)), ("GI", group_iters), ("STAGES", tiles.stages),
            ("TM", tiles.tm), ("WM", tiles.wm), ("WN", tiles.wn), ("ZFOLD", tiles.zfold))


@functools.cache
def _kernel_or_error(device: torch.device, defines: tuple[tuple[str, int], ...]) -> object:
    from pagedllm.api.kernels import RtcError, load_kernel

    try:
        return load_kernel(_source(), "w4a16_mma_gemm", device, dict(defines))
    except (RtcError, OSError, RuntimeError) as exc:
        return exc


def usable(layout: PackedLayout, x: torch.Tensor, scales: torch.Tensor, qweight: torch.Tensor, n: int) -> bool:
    """gemm_reason is None and the kernel of the default tiles compiled (a failure is logged once)."""
    if gemm_reason(layout, x, scales, qweight, n) is not None:
        return False
    from pagedllm.api.kernels import sm_count

    k = x.shape[-1]
    tiles = gemm_tiles(x.numel() // k, n, k, sm_count(x.device.index))
    got = _kernel_or_error(x.device, _defines(x.dtype, tiles, _group_of(layout, k) // 32))
    if isinstance(got, Exception):
        _warn_once(str(got))
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("w4a16 tensor-core GEMM unavailable, the other routes run instead: %s", message)


def _group_of(layout: PackedLayout, k: int) -> int:
    return layout.group_size if 0 < layout.group_size < k else k


def w4a16_mma_gemm(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    tiles: GemmTiles | tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(layout, ...) in x's dtype; gemm_reason(...) must be None. `out`: a
    contiguous [M, N] tensor of x's dtype to write instead of a new one; `tiles` overrides gemm_tiles."""
    from pagedllm.api.kernels import launch_rtc as launch
    from pagedllm.api.kernels import sm_count, tickets

    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1 or flat.stride(0) % 8 or flat.data_ptr() % 16:
        flat = flat.clone(memory_format=torch.contiguous_format)  # 16-byte aligned rows for cp.async
    m = flat.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.is_contiguous() and y.dtype == x.dtype, (tuple(y.shape), m, n)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    t = GemmTiles(*tiles) if tiles is not None else gemm_tiles(m, n, k, sm_count(x.device.index))
    assert n % t.block_n == 0, (n, t)
    group = _group_of(layout, k)
    kernel = _kernel_or_error(x.device, _defines(x.dtype, t, group // 32))
    if isinstance(kernel, Exception):
        raise kernel
    k_tiles = k // K_TILE
    per_split = -(-k_tiles // t.split)
    split = -(-k_tiles // per_split)  # every slice owns at least one k-tile, so every partial is written
    grid = (-(-m // t.block_m), n // t.block_n, split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    ticket_buf = tickets(x.device, grid[0] * grid[1]) if split > 1 else y
    launch(kernel, grid, (32 * t.wn * t.wm, 1, 1),
           [flat, qweight, qzeros, scales, y, part, ticket_buf, m, n, k, flat.stride(0), qzeros.stride(0),
            scales.stride(0), per_split, layout.zero_offset], shared_mem=t.shared_bytes)
    return y.reshape(*x.shape[:-1], n)
