"""A block-wise decode GEMV for GGUF's 32-weight types Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (y = x @ W^T, M <= 4).

gguf/triton_gemm.py's GEMV evaluates one weight per tile element (its NOTE 1: ~2 loads and ~13 SASS per weight);
this one gives a thread whole blocks. The weight is the file's uint8 [N, bytes per row], read as 16-bit words:
every block size (18, 20, 22, 24, 34 B), field offset and row stride is even, so word w of block b of row n
is at int16 index n * stride / 2 + b * TS / 2 + w, aligned, for every type (4-byte words would be misaligned
for every other Q4_0 block). Per block, by word:

    Q4_0  d | qs x 8           code word j (0..7) = qs[2j] | qs[2j + 1] << 8: its nibbles, low bits first,
    Q4_1  d | m | qs x 8       are weights 2j, 2j + 16, 2j + 1, 2j + 17 (gguf-py: byte i's low nibble is
    Q5_0  d | qh x 2 | qs x 8  weight i, its high nibble weight i + 16); Q5_x add bit i of the 32-bit qh
    Q5_1  d | m | qh x 2 | qs x 8                                                   as weight i's bit 4
    Q8_0  d | qs x 16          word j: int8 weights 2j (low byte) and 2j + 1 (high byte)

    grid (cdiv(N, BLOCK_N), SPLIT_K)   program (n block, slice of the row's blocks)
    step (BLOCK_B blocks)              words [BLOCK_N, BLOCK_B] per word index, d (and m) once per block;
                                       one warp lies along the blocks (32 adjacent blocks: 576 contiguous
                                       bytes of a Q4_0 row per load instruction) and a thread owns its
                                       block's BLOCK_N rows, so each x value it loads meets BLOCK_N weights
    per block and activation row m     p = sum_i x[m, i] q_i (float32), then acc_m += d p (+ m sum_i x[m, i])
    end                                one cross-lane sum per program; split-K as the W4A16 tiled GEMV
                                       (layers/split_k.py: float32 partials, a ticket per n block,
                                       the last program sums in a fixed order, `sum_split_partials`)

Loads per weight at M = 1 with BLOCK_N = 8: Q4_0 9 / 32 for the block + 32 / (32 x 8) for x = 0.41 (the
element-wise kernel: ~2). Arithmetic per weight: one LOP3 that masks the code in place and ORs in 2^23's
exponent (NOTE 4), one FADD that takes 2^23 (+ the code's offset: 8 for Q4_0, 16 for Q5_0, 128 for Q8_0's
sign-flipped byte) back off -- exact, and no I2F (16 per clock per SM on sm_90, an eighth of FFMA's) --
then one FFMA per activation row.

NOTE 1 (rounding): the codes are exact small integers in float32, so per block and row the only roundings are
the 32-term sum p and `d p`; the element-wise kernel rounds `d (q - 8)` per weight instead. Both are float32
sums of the same products within ~K ulps; the tests bound both by 1e-6 sum |x| |w| against float64.
NOTE 2: under TRITON_INTERPRET=1 (the CPU tests) only float32 / float16 math is right; bfloat16 is not.
NOTE 3 (determinism, CUDA graphs): every sum's order is fixed by the code and the split order, so the bits are
the same every run; the tickets are allocated on first use (the engine's eager warm-up, before capture) and
put back to 0 by the kernel, shared with every split-K GEMV (layers/split_k.py; one stream, one launch at a time).
NOTE 4 (codes masked in place): `(w >> 4t) & 15` compiled to SHF + SGXT + LOP3 per nibble; `w & 15 << 4t`
ORed into 2^23's exponent is one LOP3, and the float is 16^t q exactly (q <= 31, 16^3 q < 2^23), so the
code's offset is scaled by 16^t and x by 16^-t (a power of two: exact; one FMUL per x value, shared by the
thread's BLOCK_N rows). Per weight: LOP3, FADD, FFMA. Q8_0's high byte likewise (x by 1/256).
NOTE 5 (constants as arguments): as immediates, ptxas rematerialised the masks and the exponent with a MOV or
HFMA2 before most LOP3s (as w4a16/gemv_tiled.py NOTE 2 found); as kernel arguments they stay in registers.
NOTE 6 (sm_90a compile, block_tiles' defaults, bf16 x; SASS per weight of one step = the difference of
BLOCK_B = 64 and 32 builds): Q4_0 3.8 / 5.75 / 10.75 at M = 1 / 2 / 4 (64 / 96 / 96 registers), Q4_1 4.75 /
5.9 (80 / 168), Q8_0 5.2 / 6.75 / 12.1 (72 / 96 / 128), Q5_0 and Q5_1 ~8 at M = 1 (128: the qh bit moves);
no spills. M = 3, 4 use BLOCK_N = 4: with 8, Q4_1 at M = 4 spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import reduce_split, split_k, store_rows

BLOCK_MAX_M = 4  # accumulators unrolled for this many rows (sum_split_partials' limit too)
# ggml type id -> bytes per block (32 weights each): the types this kernel decodes.
BLOCK_TYPES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34}
_TARGET_PROGRAMS = 1584  # one-warp programs, ~12 per SM of 132 (as the W4A16 tiled GEMV)


@triton.jit
def _exact(v, expo, OFF: tl.constexpr):
    """float(v) - OFF for 0 <= v < 2^23 without I2F: v's bits under 2^23's exponent (expo = 0x4B000000, a
    kernel argument: NOTE 5), minus 2^23 + OFF."""
    return (v | expo).to(tl.float32, bitcast=True) - (8388608.0 + OFF)


@triton.jit
def _word(blk, W: tl.constexpr):
    """Word W of the blocks at uint16 pointers blk, zero-extended to int32 (a sign extension costs an SGXT)."""
    return tl.load(blk + W, eviction_policy="evict_first").to(tl.int32)


@triton.jit
def _x(xb, b_ok, SCALE: tl.constexpr):
    x = tl.load(xb, mask=b_ok, other=0.0).to(tl.float32)
    if SCALE != 1.0:
        x = x * SCALE
    return x[None, :]


@triton.jit
def _fma(p0, p1, p2, p3, q, xb, stride_xm, b_ok, IX: tl.constexpr, ROWS: tl.constexpr, SCALE: tl.constexpr = 1.0):
    """p_m += q SCALE x[m, block start + IX] for each activation row (x is [BLOCK_B], one value per block);
    SCALE is a power of two (exact), the inverse of the place value of a code masked in place (NOTE 4)."""
    p0 += q * _x(xb + IX, b_ok, SCALE)
    if ROWS > 1:
        p1 += q * _x(xb + stride_xm + IX, b_ok, SCALE)
    if ROWS > 2:
        p2 += q * _x(xb + 2 * stride_xm + IX, b_ok, SCALE)
    if ROWS > 3:
        p3 += q * _x(xb + 3 * stride_xm + IX, b_ok, SCALE)
    return p0, p1, p2, p3


@triton.jit
def _shift(v, S: tl.constexpr):
    """v << S, or v >> -S for a negative S (logical for the non-negative values used here)."""
    if S >= 0:
        return v << S
    else:
        return v >> (-S)


@triton.jit
def _x_sum(xb, b_ok):
    """sum_i x[block start + i] over a block's 32 inputs: the `m` term of Q4_1 / Q5_1."""
    s = tl.load(xb, mask=b_ok, other=0.0).to(tl.float32)
    for i in tl.static_range(1, 32):
        s += tl.load(xb + i, mask=b_ok, other=0.0).to(tl.float32)
    return s


@triton.jit
def _block_sums(blk, xb, stride_xm, b_ok, nib, expo, TYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_B: tl.constexpr):
    """p_m [BLOCK_N, BLOCK_B] = sum_i x[m, i] q_i per block, q the code less its offset (module doc)."""
    zero = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    p0, p1, p2, p3 = zero, zero, zero, zero
    if TYPE == 8:  # Q8_0: words 1..16, two int8 codes each; (byte ^ 128) - 128 is the signed byte
        lo_k = expo | 128  # (w & 255) ^ lo_k = the flipped low byte under 2^23's exponent: one LOP3
        hi_k = expo | 32768  # the high byte in place (256 x its value, NOTE 4)
        for j in tl.static_range(16):
            w = _word(blk, 1 + j)
            lo = ((w & (nib * 17)) ^ lo_k).to(tl.float32, bitcast=True) - (8388608.0 + 128.0)
            hi = ((w & (nib * 4352)) ^ hi_k).to(tl.float32, bitcast=True) - (8388608.0 + 32768.0)
            p0, p1, p2, p3 = _fma(p0, p1, p2, p3, lo, xb, stride_xm, b_ok, 2 * j, ROWS)
            p0, p1, p2, p3 = _fma(p0, p1, p2, p3, hi, xb, stride_xm, b_ok, 2 * j + 1, ROWS, 1.0 / 256)
    else:
        CW: tl.constexpr = 1 if TYPE == 2 else 2 if TYPE == 3 else 3 if TYPE == 6 else 4  # first code word
        FIVE: tl.constexpr = TYPE == 6 or TYPE == 7
        OFF: tl.constexpr = 8.0 if TYPE == 2 else 16.0 if TYPE == 6 else 0.0
        qh = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.int32)
        if FIVE:  # the 32 high bits, little-endian, in two words before the codes
            qh = _word(blk, CW - 2) | (_word(blk, CW - 1) << 16)
        for j in tl.static_range(8):
            w = _word(blk, CW + j)
            for t in tl.static_range(4):  # nibble t of the word (bits 4t..4t+3) is weight 2j + t // 2 + 16 (t % 2)
                c = w & (nib << (4 * t))  # masked in place: q 16^t (NOTE 4)
                if FIVE:  # qh's bit i moved to bit 4t + 4
                    c = c | (_shift(qh, 4 * t + 4 - (2 * j + t // 2 + 16 * (t % 2))) & (16 << (4 * t)))
                p0, p1, p2, p3 = _fma(p0, p1, p2, p3, _exact(c, expo, OFF * (16 ** t)), xb, stride_xm, b_ok,
                                      2 * j + t // 2 + 16 * (t % 2), ROWS, 1.0 / (16 ** t))
    return p0, p1, p2, p3


@triton.jit
def _gguf_block_gemv_kernel(
    w_ptr, x_ptr, y_ptr, part_ptr, ticket_ptr, N, KB, KB_PER_SPLIT, SPLITS, stride_w, stride_xm, stride_ym, nib, expo,
    TYPE: tl.constexpr, TS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    FUSED_SPLIT: tl.constexpr,
):
    WPB: tl.constexpr = TS // 2  # 16-bit words per block
    HAS_MIN: tl.constexpr = TYPE == 3 or TYPE == 7
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # Out-of-range rows read row 0 and out-of-range blocks block 0 (valid bytes); their x loads as 0 / the
    # store masks them.
    rows = (w_ptr + tl.where(n_ok, offs_n, 0).to(tl.int64) * stride_w).to(tl.pointer_type(tl.uint16))
    zero = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    a0, a1, a2, a3 = zero, zero, zero, zero
    kb_begin = pid_k * KB_PER_SPLIT
    kb_end = tl.minimum(kb_begin + KB_PER_SPLIT, KB)
    for b0 in range(kb_begin, kb_end, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        b_ok = offs_b < kb_end
        blk = rows[:, None] + (tl.where(b_ok, offs_b, 0) * WPB)[None, :]
        xb = x_ptr + offs_b * 32
        d = tl.load(blk.to(tl.pointer_type(tl.float16)), eviction_policy="evict_first").to(tl.float32)
        p0, p1, p2, p3 = _block_sums(blk, xb, stride_xm, b_ok, nib, expo, TYPE, ROWS, BLOCK_N, BLOCK_B)
        if HAS_MIN:
            m = tl.load(blk.to(tl.pointer_type(tl.float16)) + 1, eviction_policy="evict_first").to(tl.float32)
            a0 += d * p0 + m * _x_sum(xb, b_ok)[None, :]
            if ROWS > 1:
                a1 += d * p1 + m * _x_sum(xb + stride_xm, b_ok)[None, :]
            if ROWS > 2:
                a2 += d * p2 + m * _x_sum(xb + 2 * stride_xm, b_ok)[None, :]
            if ROWS > 3:
                a3 += d * p3 + m * _x_sum(xb + 3 * stride_xm, b_ok)[None, :]
        else:
            a0 += d * p0
            a1 += d * p1
            a2 += d * p2
            a3 += d * p3
    t0 = tl.sum(a0, axis=1)
    t1 = tl.sum(a1, axis=1)
    t2 = tl.sum(a2, axis=1)
    t3 = tl.sum(a3, axis=1)
    if not FUSED_SPLIT:
        store_rows(y_ptr + offs_n, stride_ym, t0, t1, t2, t3, n_ok, ROWS)
    else:  # module doc: layers/split_k.py's ticket reduction
        last, s0, s1, s2, s3 = reduce_split(part_ptr, ticket_ptr, pid_n, pid_k, offs_n, n_ok, N, SPLITS,
                                          t0, t1, t2, t3, ROWS, BLOCK_N)
        if last:
            store_rows(y_ptr + offs_n, stride_ym, s0, s1, s2, s3, n_ok, ROWS)


def block_reason(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> str | None:
    """Why the block-wise GEMV cannot take this product (None: it can); gguf_gemv then runs the element-wise one."""
    if ggml_type not in BLOCK_TYPES:
        return f"GGUF type {ggml_type} is not one of the 32-weight block types {sorted(BLOCK_TYPES)}"
    if not 1 <= x.shape[0] <= BLOCK_MAX_M:
        return f"{x.shape[0]} rows (1..{BLOCK_MAX_M})"
    if blocks.data_ptr() % 2 or blocks.stride(0) % 2:
        return "blocks not 2-byte aligned"
    return None


def block_tiles(n: int, k: int, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_B, num_warps, SPLIT_K): a warp along 32 blocks, 8 rows per thread (4 from M = 3 so the
    four accumulators and the code words stay in registers), split-K up to ~_TARGET_PROGRAMS programs."""
    block_n, block_b = (8 if m <= 2 else 4), 32
    col_blocks = triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, col_blocks), k // 32 // block_b))
    return block_n, block_b, 1, split


def gguf_block_gemv(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, K] @ W^T for M <= BLOCK_MAX_M and a BLOCK_TYPES type, in x's dtype (float32 sums).

    `tiles` (BLOCK_N, BLOCK_B, warps, SPLIT_K) overrides block_tiles (the H200 sweep; the tests)."""
    m, k = x.shape
    reason = block_reason(x, blocks, ggml_type)
    ts = BLOCK_TYPES.get(ggml_type, 0)
    assert reason is None, f"gguf_block_gemv: {reason}"
    assert k % 32 == 0 and blocks.shape[1] == k // 32 * ts and blocks.dtype == torch.uint8, (k, blocks.shape)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n, block_b, warps, split = tiles or block_tiles(n, k, m)
    kb = k // 32
    sk = split_k(x, m, n, kb, block_b, split, block_n)
    y = sk.y
    _gguf_block_gemv_kernel[(sk.col_blocks, sk.split)](
        blocks, x, y, sk.part, sk.tickets, n, kb, sk.per_split, sk.split, blocks.stride(0), x.stride(0), y.stride(0),
        15, 0x4B000000,  # NOTE 5: the nibble mask and 2^23's exponent as arguments, not immediates
        TYPE=ggml_type, TS=ts, ROWS=m, BLOCK_N=block_n, BLOCK_B=block_b, FUSED_SPLIT=sk.split > 1, num_warps=warps,
    )
    return y
