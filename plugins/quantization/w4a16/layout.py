"""The on-disk layouts of AWQ (GEMM) and GPTQ integer weights, and their torch dequantization.

Both store, per linear layer of logical weight W [N out, K in], the transposed integer codes q [K, N] packed
into int32 words, a zero point z and a scale s per (group of inputs, output), and dequantize as

    W^T[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]

AWQ GEMM (AutoAWQ `WQLinear_GEMM`), 4 bits:
    qweight [K, N/8]  int32, packed along N; word c holds outputs 8c..8c+7 with output 8c+AWQ_ORDER[i] in
                      bits 4i..4i+3 (the interleave its CUDA kernel's dequantization wants)
    qzeros  [K/G, N/8] int32, packed like qweight;   scales [K/G, N];   g(k) = k // G

GPTQ (AutoGPTQ `QuantLinear.pack`), 2/4/8 bits, pf = 32 / bits values per word:
    qweight [K/pf, N] int32, packed along K; word r holds inputs r*pf..r*pf+pf-1 in order, low bits first
    qzeros  [K/G, N/pf] int32, packed along N in order;   scales [K/G, N]
    g_idx   [K] int32: the group of each input (k // G, or a permutation's groups with desc_act / act-order)
    checkpoint_format "gptq" (v1) stores z - 1 in qzeros; "gptq_v2" stores z itself

This module is the reference for the kernels (w4a16/kernel.py) and the CPU path: plain torch, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # which output of a word's group of 8 sits in nibble i
# The inverse: the nibble that holds output j of the group (the kernel computes it as (j % 2) * 4 + j // 2).
AWQ_NIBBLE_OF_OUTPUT = tuple(AWQ_ORDER.index(j) for j in range(8))


@dataclass(frozen=True)
class PackedLayout:
    """Which packing a layer's tensors use: "awq" (GEMM) or "gptq"; bits; group size; zero offset (v1: 1)."""

    kind: str
    bits: int
    group_size: int
    zero_offset: int = 0

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def mask(self) -> int:
        return (1 << self.bits) - 1


def unpack_along_columns(packed: torch.Tensor, bits: int, awq_order: bool = False) -> torch.Tensor:
    """[R, C] int32 words -> [R, C * 32/bits] codes, values packed along the last axis (low bits first)."""
    pf = 32 // bits
    shifts = torch.arange(pf, device=packed.device, dtype=torch.int32) * bits
    if awq_order:  # output j of each group of 8 lives in nibble AWQ_NIBBLE_OF_OUTPUT[j]
        shifts = shifts[list(AWQ_NIBBLE_OF_OUTPUT)]
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then masked
    return codes.reshape(packed.shape[0], -1)


def unpack_along_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 words -> [R * 32/bits, C] codes, values packed along the first axis (low bits first)."""
    pf = 32 // bits
    shifts = torch.arange(pf, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.unsqueeze(1) >> shifts.view(1, pf, 1)) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])


def pack_along_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, C] codes -> [K * bits/32, C] int32 words, packed along the first axis (GPTQ's qweight)."""
    pf = 32 // bits
    shifts = torch.arange(pf, device=codes.device, dtype=torch.int64).view(1, pf, 1) * bits
    words = (codes.long().view(-1, pf, codes.shape[1]) << shifts).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def pack_along_columns(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> [R, C * bits/32] int32 words, packed along the last axis in order (GPTQ's qzeros)."""
    pf = 32 // bits
    shifts = torch.arange(pf, device=codes.device, dtype=torch.int64) * bits
    words = (codes.long().view(codes.shape[0], -1, pf) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_to_gptq(
    layout: PackedLayout, qweight: torch.Tensor, qzeros: torch.Tensor, rows_per_chunk: int = 1024
) -> tuple[PackedLayout, torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors -> the same codes in the GPTQ v2 packing: (layout, qweight [K/8, N], qzeros [G, N/8]).

    The bytes per weight do not change; inputs are packed along K instead of outputs along N, which lets the
    decode GEMV (w4a16/gemv.py) load one word row per eight inputs and keep the reduction over K in-thread.
    Done `rows_per_chunk` inputs at a time so the unpacked int64 codes never hold a whole layer.
    """
    assert layout.kind == "awq" and layout.bits == 4, layout
    pieces = []
    for k0 in range(0, qweight.shape[0], rows_per_chunk):
        pieces.append(pack_along_rows(unpack_along_columns(qweight[k0 : k0 + rows_per_chunk], 4, awq_order=True), 4))
    zeros = unpack_along_columns(qzeros, 4, awq_order=True)
    return PackedLayout("gptq", 4, layout.group_size, 0), torch.cat(pieces), pack_along_columns(zeros, 4)


def sort_act_order(layout: PackedLayout, qweight: torch.Tensor, g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """GPTQ act-order: (qweight with inputs sorted by group, perm) so that x[:, perm] @ W^T[perm] = x @ W^T.

    After sorting, input k belongs to group k // group_size again, so the kernels read one row of zeros and
    scales per step instead of gathering them per input. None when the groups are not all group_size long
    (then g_idx is kept and looked up per input).
    """
    perm = torch.argsort(g_idx.long(), stable=True)
    expected = torch.arange(g_idx.shape[0], device=g_idx.device) // layout.group_size
    if not torch.equal(g_idx.long()[perm], expected):
        return None
    codes = unpack_along_rows(qweight, layout.bits)[perm]
    return pack_along_rows(codes, layout.bits), perm


def unpack_codes(
    layout: PackedLayout, qweight: torch.Tensor, qzeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [K, N], z [groups, N]) as int32, the zero offset of GPTQ v1 applied."""
    if layout.kind == "awq":
        q = unpack_along_columns(qweight, layout.bits, awq_order=True)
        z = unpack_along_columns(qzeros, layout.bits, awq_order=True)
    elif layout.kind == "gptq":
        q = unpack_along_rows(qweight, layout.bits)
        z = unpack_along_columns(qzeros, layout.bits) + layout.zero_offset
    else:
        raise ValueError(f"unknown packed layout kind {layout.kind!r} (expected 'awq' or 'gptq')")
    return q, z


def dequantize(
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W^T [K, N] = (q - z[g]) * s[g] in `dtype` (scales' dtype by default); g = g_idx or k // group_size."""
    q, z = unpack_codes(layout, qweight, qzeros)
    k = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // layout.group_size
    g = g_idx.long()
    dtype = dtype or scales.dtype
    # Integer subtraction first, then one rounding in the product: the same value every reference computes.
    return (q - z[g]).to(dtype) * scales[g].to(dtype)
