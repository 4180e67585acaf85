"""The Mamba kernels a layer calls, each picking its implementation: Triton on CUDA tensors, torch elsewhere.

Decode: the one-token conv and state updates. Prefill (`prefill_conv1d`, `prefill_scan`): on CUDA one
Triton program per (request, head, channel block) runs the recurrence token by token with the state in
registers; elsewhere the torch references run (Mamba-1's token loop, Mamba-2's chunked SSD). Triton is
imported only when a CUDA tensor arrives, so CPU-only installs never load it.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.plugins.models.mamba.conv1d import causal_conv1d_update as _torch_conv1d_update
from pagedllm.plugins.models.mamba.conv1d import causal_conv1d_varlen
from pagedllm.plugins.models.mamba.selective_scan import selective_scan_varlen
from pagedllm.plugins.models.mamba.selective_scan import selective_state_update as _torch_state_update
from pagedllm.plugins.models.mamba.ssd import ssd_chunk_scan_varlen
from pagedllm.plugins.models.mamba.state import MambaStepInfo

__all__ = ["causal_conv1d_update", "prefill_conv1d", "prefill_scan", "selective_state_update"]


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_available()


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See pagedllm.plugins.models.mamba.conv1d.causal_conv1d_update."""
    if _use_triton(x):
        from pagedllm.plugins.models.mamba.triton_kernels import triton_conv1d_update

        return triton_conv1d_update(x, conv_states, weight, bias, state_indices, has_initial_state, activation)
    return _torch_conv1d_update(x, conv_states, weight, bias, state_indices, has_initial_state, activation)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """See pagedllm.plugins.models.mamba.selective_scan.selective_state_update."""
    fn = _torch_state_update
    if _use_triton(x):
        from pagedllm.plugins.models.mamba.triton_kernels import triton_selective_state_update

        fn = triton_selective_state_update
    return fn(state, x, dt, A, B, C, state_indices, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
              has_initial_state=has_initial_state)


def prefill_conv1d(
    x: torch.Tensor,  # [T', D] the prefill rows
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    step: MambaStepInfo,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The causal conv over the step's prefill requests (see mamba_conv1d.causal_conv1d_varlen)."""
    if _use_triton(x):
        from pagedllm.plugins.models.mamba.triton_kernels import triton_conv1d_varlen

        return triton_conv1d_varlen(
            x, weight, bias, conv_states, step.prefill_query_start_loc_dev, step.prefill_slots,
            step.prefill_has_state_dev, activation,
        )
    return causal_conv1d_varlen(
        x, weight, bias, conv_states, step.prefill_query_start_loc, step.prefill_slots, step.prefill_has_state,
        activation,
    )


def prefill_scan(
    ssm_states: torch.Tensor,  # [S, H, P, N] (Mamba-1: H = 1, P = channels)
    x: torch.Tensor,  # [T', H, P]
    dt: torch.Tensor,  # [T', H] (one per head, Mamba-2) or [T', H, P] (Mamba-1)
    A: torch.Tensor,  # [H] (Mamba-2) or [H, P, N] (Mamba-1)
    B: torch.Tensor,  # [T', G, N]
    C: torch.Tensor,  # [T', G, N]
    step: MambaStepInfo,
    *,
    D: torch.Tensor | None,  # [H] (Mamba-2) or [H, P]
    dt_bias: torch.Tensor | None,  # [H] (Mamba-2) or [H, P]
    z: torch.Tensor | None = None,  # [T', H, P]
    chunk_size: int = 0,  # Mamba-2's SSD chunk (the torch path); 0 for Mamba-1
    dt_limit: tuple[float, float] = (float("-inf"), float("inf")),
) -> torch.Tensor:  # [T', H, P]
    """The recurrence over the step's prefill requests, from each one's stored state; stores the final states.

    Mamba-2 passes per-head dt / A / D / dt_bias (`dt.dim() == 2`) and a chunk size; Mamba-1 the per-channel
    tensors of its single head. dt is softplus(dt + dt_bias), clamped to dt_limit.
    """
    per_head = dt.dim() == 2
    if _use_triton(x):
        from pagedllm.plugins.models.mamba.triton_kernels import triton_scan_varlen

        heads, p, n = x.shape[1], x.shape[2], B.shape[2]
        if per_head:  # expand the head scalars over P (stride-0 views, no copies)
            dt = dt[:, :, None].expand(-1, heads, p)
            A = A[:, None, None].expand(heads, p, n)
            D = None if D is None else D[:, None].expand(heads, p)
            dt_bias = None if dt_bias is None else dt_bias[:, None].expand(heads, p)
        return triton_scan_varlen(
            ssm_states, x, dt, A, B, C, step.prefill_query_start_loc_dev, step.prefill_slots,
            step.prefill_has_state_dev, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit,
        )
    qsl, slots, has = step.prefill_query_start_loc, step.prefill_slots, step.prefill_has_state
    if per_head:
        if z is not None:
            raise ValueError("the SSD path takes no z gate (Mamba-2 gates in its norm)")
        return ssd_chunk_scan_varlen(
            x, dt, A, B, C, ssm_states, qsl, slots, has, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=dt_limit,
        )
    # Mamba-1: the single head's channels are the scan's channels.
    y = selective_scan_varlen(
        x[:, 0], dt[:, 0], A[0], B[:, 0], C[:, 0], ssm_states[:, 0], qsl, slots, has,
        D=None if D is None else D[0], z=None if z is None else z[:, 0],
        delta_bias=None if dt_bias is None else dt_bias[0], delta_softplus=True,
    )
    return y[:, None]
