"""Mamba2Mixer: the Mamba-2 layer (SSD: one scalar decay per head) over the paged engine's flat, varlen batches.

For the rows of a step (decodes first, then prefill chunks), with I = heads * head_dim, G groups of B/C:

    z, xBC, dt = split(in_proj(h))                    [T, I], [T, I + 2 G N], [T, heads]
    xBC        = silu(causal_conv1d(xBC))             per request, continuing its stored conv state
    x, B, C    = split(xBC)                           [T, heads, P], [T, G, N], [T, G, N]
    y          = ssd(x, dt + dt_bias, A = -exp(A_log), B, C, D)   per request, continuing its SSM state
    out        = out_proj(gated_rms_norm(y, z))       norm over each of G groups of I / G channels, after
                                                      multiplying by silu(z) (transformers' MambaRMSNormGated)

Parameter names follow transformers' Mamba2Mixer (in_proj, conv1d, dt_bias, A_log, D, norm.weight, out_proj).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.api import MambaSpec
from pagedllm.api.model import ModelBuildContext, ReplicatedLinear
from pagedllm.plugins.models.mamba.mixer import Conv1dWeights, require_single_rank
from pagedllm.plugins.models.mamba.ops import (
    causal_conv1d_update,
    prefill_conv1d,
    prefill_scan,
    selective_state_update,
)
from pagedllm.plugins.models.mamba.state import MambaStepInfo, state_views


class GatedRMSNorm(nn.Module):
    """y = weight * rms_norm_per_group(x * silu(gate)), in float32 then cast back (MambaRMSNormGated)."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        if size % group_size:
            raise ValueError(f"gated norm: {size} channels do not split into groups of {group_size}")
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float() * F.silu(gate.float())
        grouped = x32.view(*x32.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(x32).to(x.dtype)


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 layer's sizes and options; hybrid configs (Bamba) spell the same fields `mamba_*`."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    norm_eps: float
    activation: str
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @classmethod
    def from_mamba2_config(cls, cfg: Any) -> Mamba2Dims:
        """From transformers' Mamba2Config."""
        expected = int(getattr(cfg, "expand", 2) * cfg.hidden_size)
        if int(cfg.num_heads) * int(cfg.head_dim) != expected:
            raise ValueError(
                f"Mamba2 config: num_heads * head_dim = {int(cfg.num_heads) * int(cfg.head_dim)} but "
                f"expand * hidden_size = {expected}"
            )
        return cls(
            hidden_size=int(cfg.hidden_size), num_heads=int(cfg.num_heads), head_dim=int(cfg.head_dim),
            n_groups=int(cfg.n_groups), state_size=int(cfg.state_size), conv_kernel=int(cfg.conv_kernel),
            chunk_size=int(cfg.chunk_size), use_bias=bool(getattr(cfg, "use_bias", False)),
            use_conv_bias=bool(getattr(cfg, "use_conv_bias", True)), norm_eps=float(cfg.layer_norm_epsilon),
            activation=str(cfg.hidden_act), time_step_limit=_limit(getattr(cfg, "time_step_limit", None)),
        )


def _limit(value: Any) -> tuple[float, float]:
    lo, hi = value or (0.0, float("inf"))
    return float(lo), float(hi)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer. `kv_group_id` names its KV-cache group in a hybrid model (the engine sets it)."""

    kv_group_id: int = 0

    def __init__(self, ctx: ModelBuildContext, prefix: str, dims: Mamba2Dims | None = None) -> None:
        super().__init__()
        require_single_rank(ctx, prefix)
        d = dims or Mamba2Dims.from_mamba2_config(ctx.hf_config)
        self.num_heads, self.head_dim = d.num_heads, d.head_dim
        self.intermediate_size = d.num_heads * d.head_dim
        self.n_groups, self.state_size = d.n_groups, d.state_size
        self.conv_kernel, self.chunk_size = d.conv_kernel, d.chunk_size
        self.time_step_limit = d.time_step_limit
        self.activation = d.activation
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"{prefix}: hidden_act '{self.activation}' not supported (silu)")
        if self.num_heads % self.n_groups:
            raise ValueError(f"{prefix}: {self.num_heads} heads do not split into {self.n_groups} groups")
        inter, gn = self.intermediate_size, self.n_groups * self.state_size
        self.conv_dim = inter + 2 * gn
        self.in_proj = ReplicatedLinear(
            ctx, d.hidden_size, inter + self.conv_dim + self.num_heads, bias=d.use_bias, prefix=f"{prefix}.in_proj"
        )
        self.conv1d = Conv1dWeights(self.conv_dim, self.conv_kernel, d.use_conv_bias, ctx.dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=ctx.dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=ctx.dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=ctx.dtype), requires_grad=False)
        self.norm = GatedRMSNorm(inter, inter // self.n_groups, d.norm_eps, ctx.dtype)
        self.out_proj = ReplicatedLinear(ctx, inter, d.hidden_size, bias=d.use_bias, prefix=f"{prefix}.out_proj")
        self.spec = MambaSpec(
            block_size=ctx.block_size,
            conv_state_shape=(self.conv_dim, self.conv_kernel - 1),
            ssm_state_shape=(self.num_heads, self.head_dim, self.state_size),
            dtype=ctx.dtype,
        )

    def forward(self, hidden: torch.Tensor, cache: torch.Tensor, step: MambaStepInfo) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes the states of the step's requests in `cache`."""
        conv_states, ssm_states = state_views(cache, self.spec)
        inter, gn = self.intermediate_size, self.n_groups * self.state_size
        z, xbc, dt = self.in_proj(hidden).split([inter, self.conv_dim, self.num_heads], dim=-1)
        nd, nt = step.num_decodes, step.num_tokens
        weight, bias = self.conv1d.kernel, self.conv1d.bias
        conv_out = torch.zeros_like(xbc)  # rows past num_tokens (graph padding) stay zero
        if nd:
            conv_out[:nd] = causal_conv1d_update(
                xbc[:nd], conv_states, weight, bias, step.decode_slots, step.decode_has_state, self.activation
            )
        if nt > nd:
            conv_out[nd:nt] = prefill_conv1d(xbc[nd:nt], weight, bias, conv_states, step, self.activation)
        x, B, C = conv_out.split([inter, gn, gn], dim=-1)
        rows = x.shape[0]
        x = x.reshape(rows, self.num_heads, self.head_dim)
        B = B.reshape(rows, self.n_groups, self.state_size)
        C = C.reshape(rows, self.n_groups, self.state_size)
        A = -torch.exp(self.A_log.float())
        y = torch.zeros_like(x)
        if nd:
            # One scalar per head, expanded over its head_dim channels for the heads-form update.
            heads, p, n = self.num_heads, self.head_dim, self.state_size
            y[:nd] = selective_state_update(
                ssm_states, x[:nd], dt[:nd, :, None].expand(nd, heads, p), A[:, None, None].expand(heads, p, n),
                B[:nd], C[:nd], step.decode_slots, D=self.D[:, None].expand(heads, p),
                dt_bias=self.dt_bias[:, None].expand(heads, p), dt_softplus=True,
                has_initial_state=step.decode_has_state,
            )
        if nt > nd:
            y[nd:nt] = prefill_scan(
                ssm_states, x[nd:nt], dt[nd:nt], A, B[nd:nt], C[nd:nt], step, D=self.D, dt_bias=self.dt_bias,
                chunk_size=self.chunk_size, dt_limit=self.time_step_limit,
            )
        return self.out_proj(self.norm(y.reshape(rows, inter), z))

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.n_groups}, state={self.state_size}, "
            f"conv={self.conv_kernel}, kv_group={self.kv_group_id}"
        )
