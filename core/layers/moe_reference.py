"""The torch reference of the fused-MoE op: every expert's gated MLP over the tokens routed to it.

One op signature for every implementation (this reference on the CPU, the Triton kernel of
`pagedllm.layers.fused_moe_triton` on CUDA; `pagedllm.layers.moe.fused_moe` picks):

    hidden       [T, H]        the tokens
    w13          [E, 2*I, H]   per expert: rows [0:I] the gate projection, rows [I:2I] the up projection
    w2           [E, H, I]     per expert: the down projection
    topk_weights [T, K]        float32, each token's weight for its k-th expert
    topk_ids     [T, K]        int32, each token's k-th expert (every id in [0, E))
    w13_bias     [E, 2*I]      optional, added after w13 (same gate | up order)
    w2_bias      [E, H]        optional, added after w2
    -> out       [T, H]        out[t] = sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden[t])

    expert(e, x) = w2[e] @ act(g, u) + w2_bias[e]   with  [g | u] = w13[e] @ x + w13_bias[e]

`activation` (vLLM's names):
    "silu"       act = silu(g) * u
    "gelu"       act = gelu(g) * u                       (exact erf GELU)
    "swigluoai"  gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate):
                     g = min(g, limit);  u = clamp(u, -limit, limit)
                     act = (u + 1) * g * sigmoid(alpha * g)
                 alpha = swiglu_alpha (default 1.702), limit = swiglu_limit (default 7.0)
`swiglu_alpha` / `swiglu_limit` belong to "swigluoai" only: given with another activation they are an error,
never ignored. I here is this rank's share of the intermediate size (tensor parallelism shards it; the
caller all-reduces the partial sums, and adds w2_bias on one rank only -- pagedllm.layers.moe does both).

The (token, k) pairs are sorted by expert, so each expert runs two matmuls over one contiguous slice of
gathered rows -- the grouped GEMM a fused kernel does in one launch -- and the results are scattered back
with the routing weight applied. Products accumulate in float32 and the sum is cast to hidden's dtype once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "swigluoai")
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def check_moe_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float | None,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or value does not fit the op's contract.

    Shapes and dtypes only: checking that every id is below E would read the ids back from the device.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if activation != "swigluoai" and (swiglu_limit is not None or swiglu_alpha is not None):
        raise ValueError(f"swiglu_limit / swiglu_alpha apply to activation 'swigluoai' only, not {activation!r}")
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got {tuple(hidden.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_tokens, hidden_size = hidden.shape
    experts, two_i, w13_h = w13.shape
    if w13_h != hidden_size or two_i % 2 or tuple(w2.shape) != (experts, hidden_size, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden size {hidden_size} "
                         f"(w13 [E, 2I, H], w2 [E, H, I])")
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must "
                         f"both be [T={num_tokens}, K]")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, not {topk_weights.dtype}")
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids must be int32, not {topk_ids.dtype}")
    if w13_bias is not None and tuple(w13_bias.shape) != (experts, two_i):
        raise ValueError(f"w13_bias {tuple(w13_bias.shape)} must be [E, 2I] = {(experts, two_i)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (experts, hidden_size):
        raise ValueError(f"w2_bias {tuple(w2_bias.shape)} must be [E, H] = {(experts, hidden_size)}")


def apply_moe_activation(
    gate_up: torch.Tensor, activation: str, swiglu_limit: float | None, swiglu_alpha: float | None
) -> torch.Tensor:
    """[n, 2I] gate | up -> [n, I], as the module docstring defines each activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    limit = SWIGLUOAI_LIMIT if swiglu_limit is None else swiglu_limit
    alpha = SWIGLUOAI_ALPHA if swiglu_alpha is None else swiglu_alpha
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """[T, H] -> [T, H]: the mixture of each token's top-k experts (the module docstring is the contract)."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit,
                   swiglu_alpha)
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.reshape(-1).long()
    # Stable sort: within one expert the pairs stay in token order, so the sums are deterministic.
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k
    weight_of_pair = topk_weights.reshape(-1)[order]
    # One host read per call (the per-expert slice bounds); the CPU path this serves pays nothing for it.
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        tokens = token_of_pair[rows]
        x = hidden[tokens]
        gate_up = x @ w13[expert].t()
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert]
        y = apply_moe_activation(gate_up, activation, swiglu_limit, swiglu_alpha) @ w2[expert].t()
        if w2_bias is not None:
            y = y + w2_bias[expert]
        out.index_add_(0, tokens, y.float() * weight_of_pair[rows, None])
    return out.to(hidden.dtype)
