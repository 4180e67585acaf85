"""Large-M W4A16: dequantize the whole packed weight into a 16-bit scratch W^T [K, N], then cuBLAS.

    W^T[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]        in the activation dtype, written once per call
    y[M, N]   = x[M, K] @ W^T                              torch.matmul: cuBLAS on the tensor cores

For a prefill or a large batch the product is bound by its FLOPs, which cuBLAS runs at the bf16 rate; the
in-register dequantizing GEMM (w4a16/kernel.py) spends its issue slots on unpacking and reached only a
quarter of that on the H200 (docs/benchmarks.md). The scratch costs a fixed ~0.5 + 2 bytes per weight of
traffic per call (read the codes, write 16 bits) and 2 bytes per weight of transient memory; from a few
hundred rows on that is small beside the GEMM. vLLM's AWQ layer and exllama's reconstruct path do the same.

    grid (word-row blocks, word-column blocks)        program: a [BLOCK_R, BLOCK_C] tile of packed words
    GPTQ order  qweight [K / pf, N]                   word (r, c) holds inputs r*pf .. r*pf + pf - 1 of output c
    AWQ order   qweight [K, N / 8]                    word (r, c) holds outputs 8c + AWQ_ORDER[i] of input r
    per code j of the word (unrolled)                 one [BLOCK_R, BLOCK_C] store: a row of W^T per word row

NOTE 1 (exactness): the value written is the one w4a16_layout.dequantize computes in the same dtype: the
integer q - z (|q - z| <= 256: 9 bits), times the scale rounded to the output dtype, in float32 -- exact for
a 16-bit output, whose scale has at most 11 significant bits -- then rounded once to the output dtype (round to
nearest even), as torch rounds its float16 / bfloat16 product. For float32 the float32 product is that rounding.
NOTE 2 (coalescing): words are read along N (GPTQ: consecutive outputs are consecutive words) and each code's
store writes BLOCK_C consecutive outputs of one input row: 16-byte loads and stores (LDG.128 / STG.128 when
N is a multiple of 8), full 32-byte sectors; the one layout conversion is the tile's row of zeros and scales,
once per program. Compiled for sm_90a: 52 registers, no spills, 6.75 SASS instructions per code (4 and 8 bits:
shift and bit-field extract, IMAD for q - z, I2F, FMUL, half an F2FP pack, the stores). W^T [K, N] (row-major) is the layout the GPTQ order produces without a transpose; it
makes x @ W^T a row-major "NN" cuBLAS GEMM, where bf16 F.linear(x, W) is "TN" (quant_bench.py times both).
NOTE 3 (groups): with no act-order and a tile inside one group (BLOCK_R inputs-worth divides the group size)
zeros and scales are one row per tile (GPTQ order: loaded once; AWQ's order: once per code); otherwise (act-order g_idx kept after load,
odd group sizes) they are gathered per input, as the GEMM does.
NOTE 4 (memory, CUDA graphs): nothing is cached -- keeping a 16-bit copy would undo W4's memory saving. The
scratch comes from the caching allocator per call and is freed after the matmul, so the largest linear's
scratch (gate_up of an 8B layer: 28672 x 4096 x 2 B = 235 MB) is the peak, which the engine's profiling run
(max_num_tokens rows, this path) counts before sizing the KV cache. Prefill and mixed steps run eagerly, but
decode steps up to max_num_seqs rows (and speculative verification steps of B x (k + 1) tokens) are replayed
from CUDA graphs (worker/cuda_graphs.py), so with max_num_seqs >= DEQUANT_MIN_M (the default is 64) this path
is captured too. That is safe: the kernel has no host sync and no data-dependent shape, and the scratch is
allocated from the graphs' shared private pool at capture; it stays reserved while the graphs live (one
largest scratch, reused by each linear of a forward and by every graph of the pool), outside the KV budget
but inside the 1 - gpu_memory_utilization margin for an 8B model.
NOTE 5: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.plugins.quantization.w4a16.layout import PackedLayout

# The dispatcher (w4a16_kernel.w4a16_matmul) sends products of at least this many rows here (wide layers from
# more: kernel.py NOTE 6). Measured on the H200 (examples/gpu/w4_gemm_probe.py, 2026-12-03, 8B layers): at 64
# rows this path took 30 / 20 / 142 / 77 us for qkv / o / gate_up / down against the in-register GEMM's 53 / 38 /
# 193 / 100; at 32 rows the GEMM still won gate_up and down (104 / 57 against 141 / 76).
DEQUANT_MIN_M = 64


@triton.jit
def _w4a16_dequant_kernel(
    qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr,
    N, K,
    stride_qw, stride_qz, stride_s, stride_out,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    AWQ: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    ONE_GROUP: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    INPUTS_PER_ROW: tl.constexpr = 1 if AWQ else PF
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    if AWQ:
        r_ok = offs_r < K
        c_ok = offs_c < N // 8
    else:
        r_ok = offs_r < K // PF
        c_ok = offs_c < N
    ok = r_ok[:, None] & c_ok[None, :]
    words = tl.load(qw_ptr + offs_r[:, None] * stride_qw + offs_c[None, :], mask=ok, other=0)
    g_tile = (pid_r * BLOCK_R * INPUTS_PER_ROW) // GROUP_SIZE  # the tile's group when ONE_GROUP (NOTE 3)
    if not AWQ:  # GPTQ: output n's zero sits in word n // pf of its group's row, in order
        z_word = offs_c // PF
        z_shift = (offs_c % PF) * BITS
        if ONE_GROUP:  # the same zeros and scales for every code of the tile: loaded once
            zw = tl.load(qz_ptr + g_tile * stride_qz + z_word, mask=c_ok, other=0)
            z_row = (((zw >> z_shift) & MASK) + ZERO_OFFSET)[None, :]
            s_row = tl.load(s_ptr + g_tile * stride_s + offs_c, mask=c_ok, other=0.0)[None, :]
    for j in tl.static_range(PF):
        if AWQ:  # code j of word (k, c) is output 8c + AWQ_ORDER[j], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
            offs_k = offs_r
            offs_n = offs_c * 8 + (j % 4) * 2 + j // 4
            z_word = offs_c
            z_shift = j * BITS
        else:  # code j of word (r, n) is input r * pf + j
            offs_k = offs_r * PF + j
            offs_n = offs_c
        q = (words >> (j * BITS)) & MASK  # arithmetic shift, then masked: the code's bits
        if ONE_GROUP:
            if AWQ:  # (AWQ is repacked into the GPTQ order at load: this path is for completeness, not speed)
                zw = tl.load(qz_ptr + g_tile * stride_qz + z_word, mask=c_ok, other=0)
                z = (((zw >> z_shift) & MASK) + ZERO_OFFSET)[None, :]
                s = tl.load(s_ptr + g_tile * stride_s + offs_n, mask=c_ok, other=0.0)[None, :]
            else:
                z, s = z_row, s_row
        else:  # act-order or a group smaller than the tile: each input's own group
            g = tl.load(g_ptr + offs_k, mask=r_ok, other=0) if HAS_G_IDX else offs_k // GROUP_SIZE
            zw = tl.load(qz_ptr + g[:, None] * stride_qz + z_word[None, :], mask=ok, other=0)
            z = ((zw >> z_shift) & MASK) + ZERO_OFFSET  # a [BLOCK_C] (GPTQ) or scalar (AWQ) shift, broadcast
            s = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=ok, other=0.0)
        # NOTE 1: the scale rounded to the output dtype, an exact float32 product, one rounding.
        s = s.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = (q - z).to(tl.float32) * s
        tl.store(out_ptr + offs_k[:, None] * stride_out + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequant_blocks(layout: PackedLayout, has_g_idx: bool) -> tuple[int, int, bool, int]:
    """(BLOCK_R, BLOCK_C, ONE_GROUP, num_warps): word tiles of 16 x 128 (GPTQ: 128 inputs of 4 bits x 128
    outputs, 64 KB of bf16 per program), fewer rows when that keeps the tile inside one group (NOTE 3)."""
    per_row = 1 if layout.kind == "awq" else layout.pack_factor
    block_c = 32 if layout.kind == "awq" else 128  # AWQ: 32 words = 256 outputs per row
    block_r = 16
    if not has_g_idx:
        while block_r > 1 and layout.group_size % (block_r * per_row):
            block_r //= 2
        if layout.group_size % (block_r * per_row) == 0:
            return block_r, block_c, True, 4
    return 16, block_c, False, 4


def w4a16_dequantize(
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W^T [K, N] in `dtype`, equal to w4a16_layout.dequantize(..., dtype=dtype) (NOTE 1), in one launch."""
    k = qweight.shape[0] if layout.kind == "awq" else qweight.shape[0] * layout.pack_factor
    assert k * n < 2**31, f"w4a16_dequantize: {k} x {n} outputs overflow the kernel's int32 offsets"
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    if k == 0 or n == 0:
        return out
    block_r, block_c, one_group, warps = dequant_blocks(layout, g_idx is not None)
    rows, cols = (k, n // 8) if layout.kind == "awq" else (k // layout.pack_factor, n)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))
    _w4a16_dequant_kernel[grid](
        qweight, qzeros, scales, g_idx if g_idx is not None else qzeros, out,
        n, k,
        qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=layout.group_size,
        BITS=layout.bits,
        AWQ=layout.kind == "awq",
        HAS_G_IDX=g_idx is not None,
        ONE_GROUP=one_group,
        ZERO_OFFSET=layout.zero_offset,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return out


def w4a16_dequant_matmul(
    x: torch.Tensor,
    layout: PackedLayout,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T through a per-call 16-bit scratch (NOTE 4), in x's dtype."""
    w_t = w4a16_dequantize(layout, qweight, qzeros, scales, g_idx, n, x.dtype)
    return torch.matmul(x, w_t)
