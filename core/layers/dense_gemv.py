"""When a dense linear runs the Triton decode GEMV (dense_gemv_kernel.py) instead of cuBLAS.

Shared by the `none` quantization method (16-bit weights) and the FP8 one (e4m3 weights with row scales, at
decode sizes: NOTE 5); plugins reach both through pagedllm.api.kernels.

    the layer's switch on        `dense_gemv` on its method (method.py), from the engine config's
                                 `dense_gemv` at construction (PAGEDLLM_DENSE_GEMV=true; off: always cuBLAS)
    x on CUDA, triton present    (the CPU keeps torch's matmul: the interpreter is for tests only)
    x and W both bf16 or fp16    W contiguous along K; the bias, if any, in the same dtype (or W e4m3: NOTE 5)
    rows M <= GEMV_MAX_M         (prefill and batched decode are matmuls: cuBLAS)
    the shape's table entry      GEMV_TABLE[(M, N, K)]: blocks, or None where the H200 sweep found cuBLAS
                                 faster; a shape outside the table takes default_blocks up to DEFAULT_MAX_M rows
                                 (M = 1: a rule from the SM count and the shape, NOTE 4)

This module imports no triton: the kernel module is imported on the first GEMV call.

NOTE 1: the switch lives on each layer's method, fixed when the layer is built, so two engines in one process
can differ; an A/B run of one loaded model flips `method.dense_gemv` and re-captures its CUDA graphs
(examples/gpu/gemv_sweep.py).
NOTE 2: a decode step's shapes are fixed, so the table lookup is a dict hit per call; graphs capture the
choice made at capture time.
NOTE 3 (`gated_down`): a SwiGLU MLP at decode runs gate_up, SiLU-and-mul, down: three launches, the middle
one ~1.5-2 us in a graph for 14,336 values. When the down projection would take the GEMV, the GEMV reads
[gate | up] and forms silu(gate) * up itself, rounded as SiluAndMul rounds (dense_gemv_kernel NOTE 5): one
launch fewer per layer, the same values. It uses the down projection's table entry and switch.
Measured on the H200 it LOST: W3 4.307 ms/token folded vs 4.236 unfolded (the gated GEMV reads twice the
activations per K step and its loads fill fewer registers' worth of weights), so it is off unless a model's
activation module sets `fold_into_gemv = True` (gemv_sweep.py's A/B switch); the MLP asks the down
projection's method through pagedllm.layers.activation.fused_act_down, which reaches `apply_act_then`.
NOTE 5 (FP8 weights): the table was swept on 16-bit weights, so e4m3 weights take the rule's blocks, sized for
1-byte elements (NOTE 4's bytes in flight), up to DEFAULT_MAX_M rows. The FP8 method's alternative is the W8A8
path (a quantization pass over x, then torch._scaled_mm), not a 16-bit cuBLAS GEMM. On the H200
(examples/gpu/fp8_gemm_check.py, 8B linears) the GEMV took 0.36-0.71x the W8A8 path's time at 1 and 2 rows,
but at 4 rows 0.97-1.97x (gate_up 94 against 48 us: the 2-row tiles of default_blocks): so 2 rows at most.
Through the engine the 8B single stream went 5.22 -> 2.98 ms/token, and 2.75 with _warps' 16-byte slices
(vLLM's FP8: 3.49).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.layers.fused_ops import triton_available

GEMV_MAX_M = 4  # the kernel's accumulators are unrolled for at most this many rows
DEFAULT_MAX_M = 2  # shapes not in GEMV_TABLE take the GEMV up to this many rows
# Programs per SM the default split of K aims at above M = 1: 4-warp programs of ~48 registers, ~10 resident
# per SM (dense_gemv_kernel NOTE 1); more only shortens each program's stream.
PROGRAMS_PER_SM = 8


class DenseGemvBlocks(NamedTuple):
    """Tunables of one launch: tile [block_n, block_k], warps, and the requested split of K."""

    block_n: int
    block_k: int
    num_warps: int
    split_k: int


# (M, N, K) -> blocks, or None where cuBLAS wins: the H200 sweep's choices (`python examples/gpu/gemv_sweep.py`,
# 2026-11-29 22:07 UTC, Llama-3.1-8B shapes, bf16, CUDA graphs, weights rotated past L2). M = 1: qkv 1.18x,
# o 1.30x, gate_up 1.04x, down 1.13x, LM head 1.07x cuBLAS's time -- one layer 117.3 -> 106.3 us; M = 4 only
# o gains. Through the engine W3 went 4.862 -> 4.236 ms/token (SiLU not folded: NOTE 3), tokens equal 64/64.
# M = 1 takes the rule (NOTE 4), which gives that sweep's qkv, o, gate_up and down blocks; the LM head's
# (16 rows where the rule says 4: within 1 % on the 1B head) stays pinned. Three shapes where the rule's
# blocks lost by more than 1 % to the table's earlier default (`python3 examples/gpu/small_gemv_check.py`,
# H200, 2026-12-02 04:01 UTC, old and new alternated) keep that default: Qwen2.5-7B's o (9.7 vs 9.9 us),
# Gemma-2-2B's gate_up (23.8 vs 27.8 us) and its 256,000-entry LM head (269.5 vs 274.3 us).
GEMV_TABLE: dict[tuple[int, int, int], DenseGemvBlocks | None] = {
    (1, 128256, 4096): DenseGemvBlocks(16, 1024, 4, 1),
    (1, 3584, 3584): DenseGemvBlocks(8, 1024, 4, 2),
    (1, 18432, 2304): DenseGemvBlocks(8, 1024, 4, 1),
    (1, 256000, 2304): DenseGemvBlocks(8, 1024, 4, 1),
    (2, 6144, 4096): DenseGemvBlocks(2, 1024, 4, 1),
    (2, 4096, 4096): DenseGemvBlocks(4, 1024, 4, 1),
    (2, 28672, 4096): None,
    (2, 4096, 14336): DenseGemvBlocks(4, 1024, 4, 1),
    (2, 128256, 4096): DenseGemvBlocks(4, 2048, 8, 1),
    (4, 6144, 4096): None,
    (4, 4096, 4096): DenseGemvBlocks(2, 1024, 4, 1),
    (4, 28672, 4096): None,
    (4, 4096, 14336): None,
    (4, 128256, 4096): None,
}


@functools.cache
def sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def split_for(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """The split of K that brings cdiv(n, block_n) column blocks to about `programs` programs: whole steps
    per split, so the value returned is the split the kernel will run (dense_gemv_kernel.dense_gemv)."""
    col_blocks = -(-n // block_n)
    steps = -(-k // block_k)
    wanted = max(1, min(-(-programs // col_blocks), steps))
    return -(-steps // -(-steps // wanted))


# NOTE 4 (the M = 1 rule): a single row's GEMV is a stream, so the blocks must (a) keep enough bytes of W in
# flight on every SM -- Little's law: the read stream's ~31 GB/s per SM (4.13 TB/s / 132 on the H200) times
# ~1.3 us of loaded latency (assumed, not measured) is ~40 KB; on the H200 sweep the threshold sits between
# Qwen3-4B's o at 38.8 KB, which gained 3 % from a wider step, and Llama-1B's qkv at 46.5 KB, which lost 3 %
# -- and (b) spread the programs evenly over the SMs, waves included. The narrowest tile that does both wins
# (more, shorter programs hide each other's latency); a wider BLOCK_K where it divides K comes next, more rows
# next, a split of K last (its partials and ticket cost a round trip of L2). Fitted on the H200 sweep of every
# Llama-3.2-1B and Qwen3-4B linear at M = 1 (examples/gpu/small_gemv_check.py --explore, 2026-12-02): the
# rule's blocks are the fastest of the 24-point grid or within 2 % of it, and it gives the Llama-8B sweep's
# qkv / o / gate_up / down blocks. Old blocks against the rule's, one token's GEMVs (same script, A B A B):
# Llama-3.2-1B 775 -> 685 us (3.19 -> 3.61 TB/s), Qwen3-4B 2389 -> 2176 us, Llama-8B unchanged.
IN_FLIGHT_BYTES = 40 << 10
MIN_BALANCE = 0.9  # the busiest SM's programs against the mean (waves rounded up)
_WARPS_PER_SM, _PROGRAMS_PER_SM_MAX = 64, 32  # Hopper's residency limits per SM


def _resident(warps: int) -> int:
    return min(_PROGRAMS_PER_SM_MAX, _WARPS_PER_SM // warps)


def balance(programs: int, sms: int, warps: int) -> float:
    """The mean SM's share of the programs over the busiest SM's (1.0: even), the last wave's tail included."""
    slot = sms if programs <= sms * _resident(warps) else sms * _resident(warps)
    return programs / (slot * -(-programs // slot))


def in_flight_bytes(programs: int, sms: int, warps: int, step_bytes: int) -> float:
    """Bytes of W one SM has in flight: its resident programs' loads of one step each (NOTE 4)."""
    return min(programs, sms * _resident(warps)) * step_bytes / sms


def block_widths(k: int) -> tuple[int, ...]:
    """BLOCK_K candidates, first choice first: 1024 then 2048 where they divide K, else 512 (unmasked loads,
    dense_gemv_kernel NOTE 3); a K none divides narrows 1024 down to its size (masked)."""
    if k % 1024 == 0:
        return (1024, 2048) if k % 2048 == 0 else (1024,)
    if k % 512 == 0:
        return (512,)
    return (_narrowed_block_k(k),)


def _narrowed_block_k(k: int) -> int:
    """1024, halved while it is at least twice K (a small K takes one narrow, masked step)."""
    block_k = 1024
    while block_k > 8 and block_k >= 2 * k:
        block_k //= 2
    return block_k


def _warps(block_k: int, element_bytes: int) -> int:
    """Warps along K such that each thread's slice of a row is one 16-byte load: 8 16-bit weights, 16 e4m3 ones.
    For FP8 the H200 grid (examples/gpu/fp8_gemm_check.py --explore, 8B linears at one row) put 4 warps at BLOCK_K
    2048 first on o, gate_up and down (6.35 / 29.3 / 16.1 us against 7.22 / 33.5 / 18.6 at 8 warps)."""
    return max(1, block_k * element_bytes // 512)


@functools.cache
def single_row_blocks(n: int, k: int, sms: int, element_bytes: int = 2) -> DenseGemvBlocks:
    """The M = 1 blocks by NOTE 4's rule: the first (rows, width) that fills and balances the SMs unsplit,
    else 4 rows of the widest width with K split (powers of two, whole steps) until the SMs are filled.
    Cached: every uncaptured one-row GEMV call asks (a step's few distinct shapes)."""
    widths = block_widths(k)
    for block_n in (4, 8, 16):
        for block_k in widths:
            warps = _warps(block_k, element_bytes)
            programs = -(-n // block_n)
            if (balance(programs, sms, warps) >= MIN_BALANCE
                    and in_flight_bytes(programs, sms, warps, block_n * block_k * element_bytes) >= IN_FLIGHT_BYTES):
                return DenseGemvBlocks(block_n, block_k, warps, 1)
    block_n, block_k = 4, widths[-1]
    warps = _warps(block_k, element_bytes)
    steps = -(-k // block_k)
    split = 1
    while split < steps and in_flight_bytes(-(-n // block_n) * split, sms, warps,
                                            block_n * block_k * element_bytes) < IN_FLIGHT_BYTES:
        split *= 2
    split = min(split, steps)
    return DenseGemvBlocks(block_n, block_k, warps, -(-steps // -(-steps // split)))


def default_blocks(m: int, n: int, k: int, sms: int = 132, element_bytes: int = 2) -> DenseGemvBlocks:
    """M = 1: single_row_blocks. More rows: 4 (M = 2) or 2 rows of W per program, BLOCK_K = 8 x 32 x warps up
    to 1024 (dense_gemv_kernel NOTE 1), K split until ~PROGRAMS_PER_SM programs per SM."""
    if m == 1:
        return single_row_blocks(n, k, sms, element_bytes)
    block_n = 4 if m == 2 else 2
    block_k = _narrowed_block_k(k)
    warps = max(1, min(4, block_k // 256))
    return DenseGemvBlocks(block_n, block_k, warps, split_for(n, k, block_n, block_k, PROGRAMS_PER_SM * sms))


def gemv_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseGemvBlocks | None:
    """The GEMV's blocks for y = x @ weight^T (+ bias), or None when cuBLAS should take it (module rule); an
    e4m3 weight (NOTE 5) needs a GPU that converts FP8 (compute capability 8.9+: fp8_capable)."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or (weight.dtype != x.dtype and not fp8):
        return None
    if weight.dim() != 2 or weight.stride(1) != 1 or (bias is not None and bias.dtype != x.dtype):
        return None
    n, k = weight.shape
    if x.shape[-1] != k or k == 0 or n == 0:
        return None
    m = x.numel() // k
    if not 1 <= m <= GEMV_MAX_M or not triton_available():
        return None
    index = x.device.index or 0
    if fp8:
        return default_blocks(m, n, k, sm_count(index), element_bytes=1) if m <= DEFAULT_MAX_M and fp8_capable(index) else None
    return choose_blocks(m, n, k, sm_count(index))


@functools.cache
def fp8_capable(index: int) -> bool:
    """Whether device `index` converts e4m3 in hardware (sm_89+), which Triton's FP8 loads need."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def choose_blocks(m: int, n: int, k: int, sms: int) -> DenseGemvBlocks | None:
    """The table's entry for (m, n, k), else default_blocks up to DEFAULT_MAX_M rows, else None (cuBLAS)."""
    key = (m, n, k)
    if key in GEMV_TABLE:
        return GEMV_TABLE[key]
    return default_blocks(m, n, k, sms) if m <= DEFAULT_MAX_M else None


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
    """F.linear(x, weight, bias), through the Triton GEMV when `gemv` is on and the module rule says so."""
    blocks = gemv_blocks(x, weight, bias) if gemv else None
    if blocks is None:
        return F.linear(x, weight, bias)
    from pagedllm.layers.dense_gemv_kernel import dense_gemv

    return dense_gemv(x, weight, bias, blocks)


def gated_dense_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """(silu(gate) * up) @ weight^T as one GEMV that forms the activation on the fly (NOTE 3), or None when
    the module rule does not take it (the caller then runs the activation and the projection as usual)."""
    if gate_up.device.type != "cuda":
        return None
    half = gate_up.shape[-1] // 2
    if gate_up.shape[-1] != 2 * half or weight.shape[1] != half:
        return None
    blocks = gemv_blocks(gate_up[..., :half], weight, None)
    if blocks is None:
        return None
    from pagedllm.layers.dense_gemv_kernel import dense_gemv

    return dense_gemv(gate_up, weight, None, blocks, gated=True)
