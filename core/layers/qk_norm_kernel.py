"""The per-head q/k RMSNorm of Qwen3 and Gemma 3, optionally followed by RoPE, in one Triton launch.

Rows are the (token, head) pairs of q and then k, taken ROWS at a time as a [ROWS, BLOCK] tile:

    row r:  token t = r // (NUM_Q + NUM_K),  head h = r % (NUM_Q + NUM_K)
            h <  NUM_Q   q head h       at q + t * stride_qt + h * HEAD             weight wq
            h >= NUM_Q   k head h - NUM_Q at k + t * stride_kt + (h - NUM_Q) * HEAD  weight wk

q and k are the views of the fused qkv output, normalised (and rotated) in place, so the cache write and the
attention after it read the same buffer as before.

NOTE 1 (tiles): rms_norm (triton_ops.py) runs one program per row; a [T, heads, 128] view of a 16k-token
prompt step is 655k programs of 128 elements, and Qwen3-4B spent 15 % of such a step's GPU time there (119 us
a launch, two launches a layer). ROWS x BLOCK = 2048 elements a program (16 per thread at 4 warps) leaves
41k programs for that step, ~310 per SM, and one to three programs for a decode token. Measured on the H200
(examples/gpu/qk_norm_check.py, bf16, 32 q / 8 kv heads of 128, CUDA graphs): both norms and the rotation of
a layer took 874 us at 16,384 tokens and 4.5 us at 1 token as three launches, 101 us and 2.1 us as this one.
NOTE 2 (rounding): the rounding points of rms_norm followed by rotary_embedding: x * rstd rounded to the dtype
before Llama's weight multiply (Gemma: (1 + w) in float32, one rounding), the normalised head rounded to the
dtype (what the rotary kernel would have loaded), then rotated in float32 and rounded once. Under the
interpreter the result equals those two kernels' bit for bit. On the H200 a few elements in a million land
one bf16 ulp away from them (215 of 84M at 16,384 tokens, 5 of 328k at 64, none at 1): most likely the sum
of squares, reduced as a row of a 2-D tile rather than by rms_norm's one-warp 1-D block, in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch

_TILE_ELEMENTS = 2048  # NOTE 1


@triton.jit
def _scale(x, rstd, w, GEMMA: tl.constexpr, dtype: tl.constexpr):
    """The normalised, weighted head in float32, rounded to the model dtype where the torch layer rounds."""
    y = x * rstd[:, None] * (1.0 + w) if GEMMA else (x * rstd[:, None]).to(dtype).to(tl.float32) * w
    return y.to(dtype).to(tl.float32)


@triton.jit
def _qk_norm_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, pos_ptr, cos_ptr, sin_ptr,
    rows, n, stride_qt, stride_kt, stride_c, eps,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr, ROWS: tl.constexpr, GEMMA: tl.constexpr, ROPE: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < rows
    t = (r // (NUM_Q + NUM_K)).to(tl.int64)
    h = r % (NUM_Q + NUM_K)
    is_q = h < NUM_Q
    base = tl.where(is_q, q_ptr + t * stride_qt + h * HEAD, k_ptr + t * stride_kt + (h - NUM_Q) * HEAD)
    dtype = q_ptr.dtype.element_ty

    cols = tl.arange(0, BLOCK)
    cmask = cols < HEAD
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # NOTE 2: the divisor is a runtime integer, as in rms_norm, so the division compiles the same way.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
    if ROPE:
        # Neox halves (x[i], x[i + HEAD / 2]): the pairs sit in different columns of the tile, so each half is
        # loaded again (from L1) rather than moved between threads.
        i = tl.arange(0, HALF_BLOCK)
        imask = i < HEAD // 2
        m2 = rmask[:, None] & imask[None, :]
        p1 = base[:, None] + i[None, :]
        p2 = p1 + HEAD // 2
        w1 = tl.where(is_q[:, None], tl.load(wq_ptr + i, mask=imask, other=0.0).to(tl.float32)[None, :],
                      tl.load(wk_ptr + i, mask=imask, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(wq_ptr + HEAD // 2 + i, mask=imask, other=0.0).to(tl.float32)[None, :],
                      tl.load(wk_ptr + HEAD // 2 + i, mask=imask, other=0.0).to(tl.float32)[None, :])
        y1 = _scale(tl.load(p1, mask=m2, other=0.0).to(tl.float32), rstd, w1, GEMMA, dtype)
        y2 = _scale(tl.load(p2, mask=m2, other=0.0).to(tl.float32), rstd, w2, GEMMA, dtype)
        pos = tl.load(pos_ptr + t, mask=rmask, other=0).to(tl.int64)
        cos = tl.load(cos_ptr + pos[:, None] * stride_c + i[None, :], mask=m2, other=0.0)
        sin = tl.load(sin_ptr + pos[:, None] * stride_c + i[None, :], mask=m2, other=0.0)
        tl.store(p1, (y1 * cos - y2 * sin).to(dtype), mask=m2)
        tl.store(p2, (y2 * cos + y1 * sin).to(dtype), mask=m2)
    else:
        w = tl.where(is_q[:, None], tl.load(wq_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :],
                     tl.load(wk_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :])
        tl.store(base[:, None] + cols[None, :], _scale(x, rstd, w, GEMMA, dtype).to(dtype), mask=mask)


def qk_norm_in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    gemma: bool,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Normalise every head of q [T, q heads * head_dim] and k [T, kv heads * head_dim] in place, by
    q_weight / k_weight ([head_dim]); with `rope` = (positions [T], cos, sin [max_position, head_dim / 2]
    float32) also rotate them (neox style, the whole head). q and k need a unit last stride."""
    tokens = q.shape[0]
    num_q, num_k = q.shape[1] // head_dim, k.shape[1] // head_dim
    rows = tokens * (num_q + num_k)
    if not rows:
        return
    block = triton.next_power_of_2(head_dim)
    tile_rows = max(1, _TILE_ELEMENTS // block)
    positions, cos, sin = rope if rope is not None else (q, q, q)  # placeholders the kernel never reads
    launch(
        _qk_norm_kernel, (triton.cdiv(rows, tile_rows),),
        q, k, q_weight, k_weight, positions, cos, sin,
        rows, head_dim, q.stride(0), k.stride(0), cos.stride(0), eps,
        NUM_Q=num_q, NUM_K=num_k, HEAD=head_dim, BLOCK=block, HALF_BLOCK=triton.next_power_of_2(max(1, head_dim // 2)),
        ROWS=tile_rows, GEMMA=gemma, ROPE=rope is not None,
        num_warps=4,
    )
