"""Causal depthwise conv1d for Mamba layers, in plain torch (the CPU path and the oracle for the Triton kernels).

A Mamba layer convolves each channel over the last K positions (K = conv kernel, 4 in every released model).
Between steps a request keeps only the K - 1 inputs before its next token, its *conv state*:

    inputs of one request:   ... x(n-3) x(n-2) x(n-1) | x(n) x(n+1) ...   (n = tokens computed so far)
    conv state (K = 4):          [x(n-3) x(n-2) x(n-1)]  oldest first, shape [D, K - 1]
    out(t) = act(bias + sum_k weight[:, k] * x(t - (K - 1) + k))   with x(<0) = 0 for a fresh request

Tensors are token-major ([T, D], rows of several requests back to back, as the model runner lays them out);
states live in a slot tensor [S, D, K - 1] indexed by each request's state slot and are updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"conv1d activation '{activation}' is not supported (silu or none)")


def causal_conv1d_varlen(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    conv_states: torch.Tensor,  # [S, D, K - 1], updated in place
    query_start_loc: Sequence[int],  # [B + 1] host offsets of each request's rows
    state_indices: Sequence[int] | torch.Tensor,  # [B] state slot of each request
    has_initial_state: Sequence[bool],  # [B] False: the request starts from zeros (its first chunk)
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, D]
    """Convolve each request's rows, starting from its stored conv state; store the state after its last row.

    A request continuing a chunked prefill has `has_initial_state` True: its first K - 1 outputs read the
    inputs of the previous chunk from the state instead of zeros. Rows of one request never see another's.
    """
    num_channels, kernel = weight.shape
    out = torch.empty_like(x)
    for i, slot in enumerate(state_indices):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if end == start:
            continue
        rows = x[start:end].t().to(weight.dtype)  # [D, L]
        if has_initial_state[i]:
            init = conv_states[slot].to(weight.dtype)
        else:
            init = rows.new_zeros(num_channels, kernel - 1)
        window = torch.cat([init, rows], dim=-1)  # [D, K - 1 + L]
        y = F.conv1d(window[None], weight[:, None, :], bias, groups=num_channels)[0]  # [D, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        # The last K - 1 inputs, the state included when the chunk is shorter than K - 1.
        conv_states[slot] = window[:, window.shape[-1] - (kernel - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,  # [B, D] one new token per request
    conv_states: torch.Tensor,  # [S, D, K - 1], updated in place
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    state_indices: torch.Tensor,  # [B] int, on x's device
    has_initial_state: torch.Tensor | None = None,  # [B] bool on x's device; None: all True
    activation: str | None = "silu",
) -> torch.Tensor:  # [B, D]
    """One decode step: out = act(conv(state ++ x)); the state shifts left by one and takes x.

    Works on device tensors only (no host sync), so a CUDA graph can capture it. A request whose state is
    fresh (a one-token prompt scheduled as a "decode") reads zeros instead of its slot's leftovers.
    """
    state = conv_states[state_indices].to(weight.dtype)  # [B, D, K - 1]
    if has_initial_state is not None:
        state = state * has_initial_state[:, None, None].to(state.dtype)
    window = torch.cat([state, x.to(weight.dtype)[:, :, None]], dim=-1)  # [B, D, K]
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    conv_states[state_indices] = window[:, :, 1:].to(conv_states.dtype)
    return _activate(y, activation).to(x.dtype)
