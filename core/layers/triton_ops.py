"""Triton kernels for the decoder's hot elementwise ops: one launch each where torch issues 3 to 10.

    rms_norm(x, w, eps, residual=None, gemma=False)   norm(x [+ residual]) and the new residual stream
    rotary_embedding(positions, q, k, cos, sin, ...)  RoPE on q and k in place, one program per token
    act_and_mul(x, "silu" | "gelu_tanh")              act(gate) * up on a fused [gate | up] row

Imported only when a fused kernel is about to run (core/layers/fused_ops.py decides), so `import pagedllm`
never imports triton. All three are memory-bound: each element is read once and written once, the math
runs in float32 in registers, one program per row (per token for rotary, per row tile for act_and_mul).

NOTE 1 (rounding): each kernel rounds where the torch layer rounds, so on a GPU the fused model tracks the
torch path (and transformers) to the last bit wherever float32 math agrees: the residual sum is rounded to
the model dtype before it is normalised (the stream is stored in that dtype); Llama's norm rounds
x * rstd to the dtype before the weight multiply (transformers: `weight * x.to(dtype)`), Gemma's multiplies
by (1 + w) in float32 and rounds once; act(gate) is rounded before the multiply by up. Rotary is the
exception: it rotates in float32 and rounds once (torch rounds cos/sin and each product), which is closer to
the exact value, not further.

NOTE 2 (CPU tensors): under TRITON_INTERPRET=1 the same kernels run on CPU tensors in numpy; the tests use
that. bf16 arithmetic is not faithful in the interpreter, so the CPU tests cover fp32 and fp16 only.

NOTE 3 (PDL, layers/pdl.py): RMSNorm and act_and_mul come right before the decode GEMVs (qkv, gate_up, the LM
head; down), which may launch with programmatic dependent launch: each program here lets such a GEMV start,
so its weight prefetch overlaps this kernel; the GEMV still waits for this kernel's output. With no PDL
successor the trigger does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch
from pagedllm.layers.pdl import launch_dependents, trigger_on


# --------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    inner, stride_xa, stride_xb, stride_r, stride_o, stride_ro,
    N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)  # NOTE 3
    # Row r of the flattened [rows, N] view sits at x[r // inner, r % inner]: a [T, heads, head] slice of a
    # fused qkv output (Qwen3's per-head q/k norm) is read in place, without a contiguous copy.
    row = tl.program_id(0)
    a = row // inner
    b = row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)  # NOTE 1: the stream is kept (and normalised) in the model dtype
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * (1.0 + w) if GEMMA else (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * w, x + residual) -- or (norm(x) * w, None) without a residual.

    Gemma (`gemma=True`) scales by (1 + w). x is [..., N] with a unit last stride; the outputs are new
    contiguous tensors of x's shape and dtype (weight and residual must share that dtype).
    """
    n = x.shape[-1]
    shape = x.shape
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3 and residual is None:
        inner, stride_xa, stride_xb = x.shape[1], x.stride(0), x.stride(1)
    else:
        x = x.reshape(-1, n)  # a view for every 2-D or contiguous input
        inner, stride_xa, stride_xb = 1, x.stride(0), 0
    rows = x.numel() // n
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_in = res_out = out  # placeholders the kernel never touches without HAS_RESIDUAL
    if residual is not None:
        if residual.shape[-1] != n or residual.numel() != rows * n or residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match x "
                f"({rows} rows of {n}, {x.dtype})"
            )
        res_in = residual.reshape(rows, n)
        if res_in.stride(-1) != 1:
            res_in = res_in.contiguous()
        res_out = torch.empty_like(out)
    if rows:
        block = triton.next_power_of_2(n)
        launch(
            _rms_norm_kernel, (rows,),
            x, res_in, weight, out, res_out,
            inner, stride_xa, stride_xb, res_in.stride(0), out.stride(0), res_out.stride(0),
            n, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, GEMMA=gemma, PDL=trigger_on(x),
            # 16 elements per thread: hidden 4096 -> 8 warps, head 128 -> 1 warp.
            num_warps=min(16, max(1, block // 512)),
        )
    if residual is None:
        return out.view(shape), None
    return out.view(shape), res_out.view(shape)


# --------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rotate_heads(
    base, stride_h, num_heads, cos, sin, off1, off2, imask,
    H_PAD: tl.constexpr,
):
    """Rotate the pairs (x[off1], x[off2]) of every head at `base` (one token), in place."""
    h = tl.arange(0, H_PAD)[:, None]
    mask = (h < num_heads) & imask[None, :]
    p1 = base + h * stride_h + off1[None, :]
    p2 = base + h * stride_h + off2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    tl.store(p1, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, H_PAD: tl.constexpr, NEOX: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    imask = i < HALF
    # The cos/sin row is read once per token and shared by every q and k head.
    cos = tl.load(cos_ptr + pos * stride_c + i, mask=imask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + i, mask=imask, other=0.0)[None, :]
    if NEOX:  # halves: (x[i], x[i + rotary_dim / 2])
        off1 = i
        off2 = i + HALF
    else:  # GPT-J interleaved pairs: (x[2i], x[2i + 1])
        off1 = 2 * i
        off2 = 2 * i + 1
    t64 = t.to(tl.int64)
    _rotate_heads(q_ptr + t64 * stride_qt, stride_qh, NUM_Q, cos, sin, off1, off2, imask, H_PAD)
    _rotate_heads(k_ptr + t64 * stride_kt, stride_kh, NUM_K, cos, sin, off1, off2, imask, H_PAD)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_size: int,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, nh * hs] (or [T, nh, hs]) and key likewise at positions [T], in place; returns them.

    cos_cache / sin_cache are [max_position, rotary_dim / 2] float32; dims past rotary_dim are untouched.
    q and k may be strided views (slices of the fused qkv output) as long as each head is contiguous.
    """
    tokens = positions.shape[0]
    half = cos_cache.shape[-1]
    if 2 * half > head_size:
        raise ValueError(f"rotary_embedding: rotary dim {2 * half} exceeds head size {head_size}")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rotary_embedding: query and key need a unit last stride (rotated in place)")
    q = query.view(tokens, -1, head_size)
    k = key.view(tokens, -1, head_size)
    if tokens:
        launch(
            _rotary_kernel, (tokens,),
            positions, cos_cache, sin_cache, q, k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
            NUM_Q=q.shape[1], NUM_K=k.shape[1], HALF=half,
            HALF_PAD=triton.next_power_of_2(half), H_PAD=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
            NEOX=is_neox_style,
            num_warps=4,
        )
    return query, key


# ------------------------------------------------------------------------------------------ act_and_mul
@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, D,
    BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)  # NOTE 3
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): no tanh intrinsic needed
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    y = act.to(dtype).to(tl.float32) * up  # NOTE 1: act(gate) is rounded before the multiply, as in torch
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


_ACTIVATIONS = {"silu": False, "gelu_tanh": True}
_ACT_BLOCK = 1024


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[..., 2d] = [gate | up] -> act(gate) * up, [..., d]; activation is "silu" or "gelu_tanh"."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"act_and_mul: activation {activation!r} not one of {sorted(_ACTIVATIONS)}")
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"act_and_mul: last dim {two_d} is not [gate | up] (odd)")
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows and d:
        block = min(_ACT_BLOCK, triton.next_power_of_2(d))
        launch(
            _act_and_mul_kernel, (rows, triton.cdiv(d, block)),
            x2, out, x2.stride(0), out.stride(0), d,
            BLOCK=block, GELU_TANH=_ACTIVATIONS[activation], PDL=trigger_on(x2), num_warps=4,
        )
    return out.view(*x.shape[:-1], d)
