"""Gated activations for fused gate_up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.fused_ops import FusedOp, cpu_ops_of, use_fused


class SiluAndMul(FusedOp, nn.Module):
    """[..., 2d] = [gate | up] -> silu(gate) * up, [..., d] (the SwiGLU of Llama-style MLPs).

    On CUDA one Triton kernel reads the row once (core/layers/triton_ops.py); torch launches three.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops_of(self)  # fused_ops.py NOTE 3
        if ops is not None and x.dtype == torch.float32:
            return ops.silu_and_mul(x)
        if use_fused(self, x):
            from pagedllm.layers.triton_ops import act_and_mul

            return act_and_mul(x, "silu")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(FusedOp, nn.Module):
    """[..., 2d] = [gate | up] -> gelu_tanh(gate) * up, [..., d] (Gemma's GeGLU, `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(self, x):
            from pagedllm.layers.triton_ops import act_and_mul

            return act_and_mul(x, "gelu_tanh")
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_ACTIVATION_NAMES: dict[type, str] = {SiluAndMul: "silu", GeluTanhAndMul: "gelu_tanh"}


def fused_gate_up_act(gate_up: nn.Module, act: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """act(gate_up(x)) from one kernel when the layer's quantization method offers `apply_act_and_mul`
    (core/protocols/quantization.py) and takes this call, else None: the caller runs both as usual."""
    hook = getattr(getattr(gate_up, "quant_method", None), "apply_act_and_mul", None)
    name = _ACTIVATION_NAMES.get(type(act))
    if hook is None or name is None:
        return None
    result: torch.Tensor | None = hook(gate_up, x, name)
    return result


def fused_act_down(act: nn.Module, down: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
    """down(act(gate) * up) from one kernel when the activation module says `fold_into_gemv` (off by
    default: an A/B switch) and the down projection's method offers `apply_act_then` and takes this call,
    else None: the caller runs the activation and the projection as usual."""
    if not getattr(act, "fold_into_gemv", False):  # first: every other call pays one attribute lookup per layer
        return None
    from pagedllm.layers.linear import ReplicatedLinear, RowParallelLinear

    hook = getattr(getattr(down, "quant_method", None), "apply_act_then", None)
    name = _ACTIVATION_NAMES.get(type(act))
    if hook is None or name is None or not isinstance(down, (ReplicatedLinear, RowParallelLinear)):
        return None
    if down.bias is not None:
        return None
    y: torch.Tensor | None = hook(down, gate_up, name)
    if y is not None and isinstance(down, RowParallelLinear):
        from pagedllm.distributed.communication import tp_all_reduce

        y = tp_all_reduce(y, down.tp_size)
    return y
