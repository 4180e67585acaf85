"""MambaMixer: the Mamba-1 layer (selective SSM) over the paged engine's flat, varlen batches.

For the rows of a step (decodes first, then prefill chunks):

    x, z   = split(in_proj(h))                       [T, I] each (I = intermediate size)
    x      = silu(causal_conv1d(x))                  per request, continuing its stored conv state
    dt, B, C = split(x_proj(x)),  dt = dt_proj.weight @ dt      (dt_proj's bias is added inside the scan)
    y      = selective_scan(x, dt, A = -exp(A_log), B, C, D, z)  per request, continuing its SSM state
    out    = out_proj(y)

Parameter names follow transformers' MambaMixer (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj), so
checkpoints load by name. The layer's cache is one [num_blocks, conv + ssm] tensor (MambaSpec); a request's
state lives in the block its state slot names (mamba_state.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from pagedllm.api import MambaSpec
from pagedllm.api.model import ModelBuildContext, ReplicatedLinear
from pagedllm.plugins.models.mamba.ops import (
    causal_conv1d_update,
    prefill_conv1d,
    prefill_scan,
    selective_state_update,
)
from pagedllm.plugins.models.mamba.state import MambaStepInfo, state_views


class Conv1dWeights(nn.Module):
    """The depthwise conv's parameters under transformers' names (conv1d.weight [C, 1, K], conv1d.bias [C])."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None
        )

    @property
    def kernel(self) -> torch.Tensor:
        """The weight as [C, K], the kernels' layout."""
        return self.weight[:, 0, :]


def require_single_rank(ctx: ModelBuildContext, prefix: str) -> None:
    """Mamba layers are not split across tensor-parallel ranks yet; say so instead of computing garbage."""
    if ctx.tp_size != 1:
        raise ValueError(f"{prefix}: Mamba layers do not support tensor parallelism yet (tp_size {ctx.tp_size})")


class MambaMixer(nn.Module):
    """One Mamba-1 layer. `kv_group_id` names its KV-cache group in a hybrid model (the engine sets it)."""

    kv_group_id: int = 0

    def __init__(self, ctx: ModelBuildContext, prefix: str) -> None:
        super().__init__()
        require_single_rank(ctx, prefix)
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        self.intermediate_size = int(cfg.intermediate_size)
        self.state_size = int(cfg.state_size)
        self.conv_kernel = int(cfg.conv_kernel)
        self.time_step_rank = int(cfg.time_step_rank)
        self.activation = cfg.hidden_act
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"{prefix}: hidden_act '{self.activation}' not supported (silu)")
        use_bias = bool(getattr(cfg, "use_bias", False))
        inter = self.intermediate_size
        self.in_proj = ReplicatedLinear(ctx, hidden, 2 * inter, bias=use_bias, prefix=f"{prefix}.in_proj")
        self.conv1d = Conv1dWeights(inter, self.conv_kernel, bool(cfg.use_conv_bias), ctx.dtype)
        self.x_proj = ReplicatedLinear(
            ctx, inter, self.time_step_rank + 2 * self.state_size, bias=False, prefix=f"{prefix}.x_proj"
        )
        self.dt_proj = ReplicatedLinear(ctx, self.time_step_rank, inter, bias=True, prefix=f"{prefix}.dt_proj")
        self.A_log = nn.Parameter(torch.empty(inter, self.state_size, dtype=ctx.dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(inter, dtype=ctx.dtype), requires_grad=False)
        self.out_proj = ReplicatedLinear(ctx, inter, hidden, bias=use_bias, prefix=f"{prefix}.out_proj")
        self.spec = MambaSpec(
            block_size=ctx.block_size,
            conv_state_shape=(inter, self.conv_kernel - 1),
            ssm_state_shape=(inter, self.state_size),
            dtype=ctx.dtype,
        )

    def forward(self, hidden: torch.Tensor, cache: torch.Tensor, step: MambaStepInfo) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes the states of the step's requests in `cache`."""
        conv_states, ssm_states = state_views(cache, self.spec)
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        nd, nt = step.num_decodes, step.num_tokens
        weight, bias = self.conv1d.kernel, self.conv1d.bias
        xc = torch.zeros_like(x)  # rows past num_tokens (graph padding) stay zero
        if nd:
            xc[:nd] = causal_conv1d_update(
                x[:nd], conv_states, weight, bias, step.decode_slots, step.decode_has_state, self.activation
            )
        if nt > nd:
            xc[nd:nt] = prefill_conv1d(x[nd:nt], weight, bias, conv_states, step, self.activation)
        dt, B, C = self.x_proj(xc).split([self.time_step_rank, self.state_size, self.state_size], dim=-1)
        dt = dt @ cast(torch.Tensor, self.dt_proj.weight).t()  # the bias goes in with the softplus, as transformers does
        dt_bias = self.dt_proj.bias
        A = -torch.exp(self.A_log.float())
        y = torch.zeros_like(x)
        # Heads form with one head of all I channels: state [S, 1, I, N], per-channel A [1, I, N].
        states, A1, D1 = ssm_states[:, None], A[None], self.D[None]
        bias1 = None if dt_bias is None else dt_bias[None]
        if nd:
            y[:nd] = selective_state_update(
                states, xc[:nd, None], dt[:nd, None], A1, B[:nd, None], C[:nd, None], step.decode_slots,
                D=D1, z=z[:nd, None], dt_bias=bias1, dt_softplus=True, has_initial_state=step.decode_has_state,
            )[:, 0]
        if nt > nd:
            y[nd:nt] = prefill_scan(
                states, xc[nd:nt, None], dt[nd:nt, None], A1, B[nd:nt, None], C[nd:nt, None], step,
                D=D1, dt_bias=bias1, z=z[nd:nt, None],
            )[:, 0]
        return self.out_proj(y)

    def extra_repr(self) -> str:
        return (
            f"intermediate={self.intermediate_size}, state={self.state_size}, conv={self.conv_kernel}, "
            f"kv_group={self.kv_group_id}"
        )

