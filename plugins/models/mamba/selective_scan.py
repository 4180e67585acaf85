"""Selective scan (Mamba-1 prefill) and the one-token state update (Mamba-1 and Mamba-2 decode), plain torch.

The recurrence, per channel d and state index n, for a request's tokens t = 0, 1, ...:

    dt(t)   = softplus(delta(t) + delta_bias)                      (when delta_softplus)
    h(t)    = exp(dt(t) * A) * h(t-1) + dt(t) * B(t) * u(t)         h(-1) = stored state, or 0 when fresh
    y(t)    = sum_n h(t)[n] * C(t)[n] + D * u(t)      then  y(t) *= silu(z(t))   (when z is given)

Math runs in float32 whatever the model dtype (as transformers' slow path and the CUDA kernels do); the
state keeps the dtype of its slot tensor. Tensors are token-major; states live in slot tensors indexed by
each request's state slot and are updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def selective_scan_varlen(
    u: torch.Tensor,  # [T, D]
    delta: torch.Tensor,  # [T, D]
    A: torch.Tensor,  # [D, N]
    B: torch.Tensor,  # [T, N]
    C: torch.Tensor,  # [T, N]
    ssm_states: torch.Tensor,  # [S, D, N], updated in place
    query_start_loc: Sequence[int],  # [B + 1] host offsets
    state_indices: Sequence[int] | torch.Tensor,  # [B] state slots
    has_initial_state: Sequence[bool],  # [B]
    D: torch.Tensor | None = None,  # [D]
    z: torch.Tensor | None = None,  # [T, D]
    delta_bias: torch.Tensor | None = None,  # [D]
    delta_softplus: bool = False,
) -> torch.Tensor:  # [T, D]
    """Mamba-1's scan over each request's rows (one sequential pass per request), storing its final state."""
    dt = delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()
    if delta_softplus:
        dt = F.softplus(dt)
    A32, u32, B32, C32 = A.float(), u.float(), B.float(), C.float()
    y = torch.empty_like(u32)
    for i, slot in enumerate(state_indices):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if end == start:
            continue
        dA = torch.exp(dt[start:end, :, None] * A32)  # [L, D, N]
        dBu = dt[start:end, :, None] * B32[start:end, None, :] * u32[start:end, :, None]  # [L, D, N]
        h = ssm_states[slot].float() if has_initial_state[i] else u32.new_zeros(A32.shape)
        for t in range(end - start):
            h = dA[t] * h + dBu[t]
            y[start + t] = h @ C32[start + t]
        ssm_states[slot] = h.to(ssm_states.dtype)
    if D is not None:
        y = y + u32 * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(u.dtype)


def selective_state_update(
    state: torch.Tensor,  # [S, H, P, N], updated in place
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H, P]
    A: torch.Tensor,  # [H, P, N]
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    state_indices: torch.Tensor,  # [B] int, on x's device
    D: torch.Tensor | None = None,  # [H, P]
    z: torch.Tensor | None = None,  # [B, H, P]
    dt_bias: torch.Tensor | None = None,  # [H, P]
    dt_softplus: bool = False,
    has_initial_state: torch.Tensor | None = None,  # [B] bool; None: all True
) -> torch.Tensor:  # [B, H, P]
    """One decode step of the recurrence for a batch of requests, heads form (H heads of P channels).

    Mamba-1 is the case H = 1, G = 1, P = its channel count; Mamba-2 passes A, dt, D and dt_bias expanded
    over P (one scalar per head) and G groups of B/C shared by H / G heads each. Device tensors only (no
    host sync), so CUDA graphs can capture it.
    """
    heads = x.shape[1]
    groups = B.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} B/C groups")
    dt32 = dt.float()
    if dt_bias is not None:
        dt32 = dt32 + dt_bias.float()
    if dt_softplus:
        dt32 = F.softplus(dt32)
    # Each group's B and C serve heads // groups consecutive heads.
    B32 = B.float().repeat_interleave(heads // groups, dim=1)  # [B, H, N]
    C32 = C.float().repeat_interleave(heads // groups, dim=1)
    h = state[state_indices].float()  # [B, H, P, N]
    if has_initial_state is not None:
        h = h * has_initial_state[:, None, None, None].to(h.dtype)
    x32 = x.float()
    h = torch.exp(dt32[..., None] * A.float()) * h + (dt32 * x32)[..., None] * B32[:, :, None, :]
    state[state_indices] = h.to(state.dtype)
    y = (h * C32[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + x32 * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
