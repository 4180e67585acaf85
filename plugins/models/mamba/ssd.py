"""Mamba-2's chunked scan (SSD, "state space duality") over varlen requests, plain torch.

Mamba-2 restricts A to one scalar per head, so the recurrence of head h (P channels x N state entries)

    h(t) = exp(dt(t) * A) * h(t-1) + dt(t) * x(t) B(t)^T,      y(t) = h(t) C(t) + D * x(t)

can be computed a chunk of Q tokens at a time with matmuls instead of a token loop (Dao & Gu, 2024):

    a(t)      = dt(t) * A                    log-decay of one step (<= 0)
    cum(l)    = a(0) + ... + a(l)            within the chunk
    diagonal  y(l) += sum_{s<=l} exp(cum(l) - cum(s)) (C(l) . B(s)) dt(s) x(s)     (tokens of the same chunk)
    incoming  y(l) += exp(cum(l)) C(l) . h_in                                        (state entering the chunk)
    outgoing  h_out = exp(cum(Q-1)) h_in + sum_s exp(cum(Q-1) - cum(s)) dt(s) x(s) B(s)^T

A request's first chunk starts from its stored state (chunked prefill) or zeros; the last h_out is stored.
Padding the last chunk with dt = 0 leaves the state untouched (decay exp(0) = 1, no input), so it needs no
special case. Math in float32 whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def ssd_chunk_scan_varlen(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H]
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    ssm_states: torch.Tensor,  # [S, H, P, N], updated in place
    query_start_loc: Sequence[int],  # [B + 1] host offsets
    state_indices: Sequence[int] | torch.Tensor,  # [B] state slots
    has_initial_state: Sequence[bool],  # [B]
    chunk_size: int,
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:  # [T, H, P]
    """Mamba-2's scan over each request's rows, chunk by chunk; each request's final state is stored."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    heads, groups = x.shape[1], B.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} B/C groups")
    dt32 = dt.float()
    if dt_bias is not None:
        dt32 = dt32 + dt_bias.float()
    if dt_softplus:
        dt32 = F.softplus(dt32)
    dt32 = dt32.clamp(min=dt_limit[0], max=dt_limit[1])
    x32 = x.float()
    # Each group's B and C serve heads // groups consecutive heads.
    B32 = B.float().repeat_interleave(heads // groups, dim=1)  # [T, H, N]
    C32 = C.float().repeat_interleave(heads // groups, dim=1)
    y = torch.empty_like(x32)
    for i, slot in enumerate(state_indices):
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if end == start:
            continue
        h0 = ssm_states[slot].float() if has_initial_state[i] else None
        y[start:end], h = _ssd_one(
            x32[start:end], dt32[start:end], A.float(), B32[start:end], C32[start:end], h0, chunk_size
        )
        ssm_states[slot] = h.to(ssm_states.dtype)
    if D is not None:
        y = y + x32 * D.float()[:, None]
    return y.to(x.dtype)


def _ssd_one(
    x: torch.Tensor,  # [L, H, P]
    dt: torch.Tensor,  # [L, H]
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [L, H, N]
    C: torch.Tensor,  # [L, H, N]
    h0: torch.Tensor | None,  # [H, P, N]
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: outputs [L, H, P] (without the D skip) and the final state [H, P, N]."""
    length, heads, head_dim = x.shape
    state_size = B.shape[-1]
    pad = (-length) % chunk_size
    if pad:  # dt = 0 on padding: decay 1 and no input, so the state passes through unchanged
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    nc, q = (length + pad) // chunk_size, chunk_size
    xdt = (x * dt[..., None]).view(nc, q, heads, head_dim)
    Bc, Cc = B.view(nc, q, heads, state_size), C.view(nc, q, heads, state_size)
    cum = torch.cumsum((dt * A).view(nc, q, heads), dim=1)  # [nc, Q, H]

    # Diagonal blocks: decay from s to l inside the chunk, masked to s <= l before exp (it would overflow).
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    seg = cum[:, :, None, :] - cum[:, None, :, :]  # [nc, l, s, H]
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", Cc, Bc) * decay
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)

    # What each chunk adds to the state it passes on, then the (short) sequential pass over chunks.
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [nc, Q, H]
    chunk_states = torch.einsum("cshn,csh,cshp->chpn", Bc, to_end, xdt)
    chunk_decay = torch.exp(cum[:, -1, :])  # [nc, H]
    h = h0 if h0 is not None else x.new_zeros(heads, head_dim, state_size)
    incoming = []
    for c in range(nc):
        incoming.append(h)
        h = chunk_decay[c][:, None, None] * h + chunk_states[c]
    h_in = torch.stack(incoming)  # [nc, H, P, N]
    y = y + torch.einsum("clhn,chpn,clh->clhp", Cc, h_in, torch.exp(cum))
    return y.reshape(nc * q, heads, head_dim)[:length], h
