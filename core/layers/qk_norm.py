"""Per-head q/k RMSNorm then RoPE (Qwen3, Gemma 3): one Triton launch on CUDA, the layers' own code elsewhere.

Those models normalise each head of q and k by a [head_dim] weight shared by the heads (q_norm, k_norm)
before rotating them. Called as three layers that is three launches a decoder layer, and the norms ran one
program per head row (qk_norm_kernel.py NOTE 1); fused it is one launch over tiles of rows, in place in the
qkv output. Light module: the kernel (and triton) is imported on the first fused call.
"""

from __future__ import annotations

import torch

from pagedllm.layers.fused_ops import use_fused
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    rotary: RotaryEmbedding,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, q heads * head_dim] and k [T, kv heads * head_dim] normalised per head by q_norm / k_norm, then
    rotated by `rotary` at positions [T]; returns them.

    Use the returned tensors. Where q_norm's mode fuses (CUDA, or 'always' under the interpreter) one kernel
    normalises q and k in place (views into the qkv output) and, when `rotary` fuses and rotates whole heads in
    neox style, rotates them in the same launch, rounding where the three layers' kernels round
    (qk_norm_kernel.py NOTE 2). Elsewhere the three layers run as they are, bit for bit as before.
    """
    if _fusable(q, k, q_norm, k_norm):
        from pagedllm.layers.qk_norm_kernel import qk_norm_in_place

        with_rope = (
            use_fused(rotary, q) and rotary.is_neox_style and rotary.rotary_dim == head_dim
            and positions.dim() == 1 and positions.shape[0] == q.shape[0]
        )
        rope = (positions, rotary.cos_cache, rotary.sin_cache) if with_rope else None
        qk_norm_in_place(q, k, q_norm.weight, k_norm.weight, q_norm.eps, head_dim, q_norm.gemma, rope)
        return (q, k) if with_rope else rotary(positions, q, k)
    tokens = q.shape[0]
    q = q_norm(q.reshape(tokens, -1, head_dim)).reshape(q.shape)
    k = k_norm(k.reshape(tokens, -1, head_dim)).reshape(k.shape)
    return rotary(positions, q, k)


def _fusable(q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> bool:
    """One kernel computes both norms: the same form and eps, one dtype throughout, 2-D q/k with unit last
    strides (heads side by side) -- what the fused qkv split gives."""
    return (
        use_fused(q_norm, q)
        and q_norm.gemma == k_norm.gemma
        and q_norm.eps == k_norm.eps
        and q.dtype == k.dtype == q_norm.weight.dtype == k_norm.weight.dtype
        and q.dim() == 2 and k.dim() == 2 and q.shape[0] == k.shape[0]
        and q.stride(-1) == 1 and k.stride(-1) == 1
    )
