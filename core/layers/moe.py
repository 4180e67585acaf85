"""Mixture-of-experts layers: top-k routers and the expert layer behind the one fused-MoE op.

    logits [T, E] = router(hidden)                        (a ReplicatedLinear the model owns)
    topk_weights [T, K] float32, topk_ids [T, K] int32 = softmax_topk(logits) or topk_softmax(logits)
    out [T, H] = all_reduce(fused_moe(hidden, w13, w2, topk_weights, topk_ids, ...))

The op's contract (shapes, activations, bias order) is pagedllm.layers.moe_reference's docstring. `fused_moe`
runs the Triton kernel of `pagedllm.layers.fused_moe_triton` for CUDA tensors when that module imports, and
the torch reference otherwise.

Tensor parallelism shards each expert's intermediate size I, as the dense MLP shards its columns: rank r
holds rows [r*I/tp, (r+1)*I/tp) of the gate and of the up projection (so w13 is [E, 2*I/tp, H], gate block
then up block) and the same columns of w2 ([E, H, I/tp]). Each rank's output is a partial sum over its slice
of I, all-reduced like a RowParallelLinear's; w2's bias is added on rank 0 only, so the sum counts it once.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.communication import tp_all_reduce
from pagedllm.layers.moe_reference import ACTIVATIONS, fused_moe_reference
from pagedllm.layers.weight_utils import WeightLoadError, copy_checked, divide, set_weight_attrs
from pagedllm.protocols.model import ModelBuildContext

FusedMoEOp = Callable[..., torch.Tensor]


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: softmax over all experts (float32), keep the top k, renormalise them to sum
    to 1 when `renormalize`. Returns (weights [T, K] float32, ids [T, K] int32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing (transformers' GptOssTopKRouter): the top k logits (the router's bias already added),
    then a softmax over those k only. Returns (weights [T, K] float32, ids [T, K] int32)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), ids.to(torch.int32)


@functools.cache
def _triton_op() -> FusedMoEOp | None:
    """The Triton fused-MoE op, or None where its module (or triton) does not import."""
    try:
        # Looked up by name: the kernel module is optional, and the CPU never imports triton.
        module = importlib.import_module("pagedllm.layers.fused_moe_triton")
    except ImportError:
        return None
    op: FusedMoEOp = module.fused_moe
    return op


def fused_moe(
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
    """The fused-MoE op (pagedllm.layers.moe_reference's contract) on the best implementation for `hidden`."""
    op = _triton_op() if hidden.is_cuda else None
    return (op or fused_moe_reference)(
        hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit, swiglu_alpha
    )


class FusedMoE(nn.Module):
    """The experts of one MoE layer: w13 [E, 2*I/tp, H], w2 [E, H, I/tp] (+ biases), run by `fused_moe`.

    Parameters load from full (unsharded) tensors in the op's layout; each loader keeps this rank's slice:

        w13_weight [E, 2I, H]  (or shard "gate" / "up": [E, I, H] each)   w13_bias [E, 2I] (or "gate" / "up")
        w2_weight  [E, H, I]                                                w2_bias  [E, H]

    A checkpoint in another layout (gpt-oss's interleaved, transposed gate_up_proj) is converted by its model.
    """

    def __init__(
        self,
        ctx: ModelBuildContext,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: str = "silu",
        swiglu_limit: float | None = None,
        swiglu_alpha: float | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if ctx.quant_config is not None:
            # Expert weights have no quantization method yet: running them dense under a quantized config
            # would silently ignore the config for most of the model's weights.
            raise ValueError(f"{prefix}: quantized MoE experts are not supported yet (quantization must be none)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{prefix}: activation {activation!r} not supported ({', '.join(ACTIVATIONS)})")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k {top_k} must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.intermediate_size = intermediate_size
        self.intermediate_per_rank = divide(intermediate_size, ctx.tp_size)
        self.activation = activation
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        local = self.intermediate_per_rank
        dtype = ctx.dtype
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.w13_weight, {"weight_loader": self._load_w13})
        set_weight_attrs(self.w2_weight, {"weight_loader": self._load_w2})
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * local, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.w13_bias, {"weight_loader": self._load_w13})
            set_weight_attrs(self.w2_bias, {"weight_loader": self._load_w2})

    def _rows(self, full: int) -> slice:
        """This rank's slice of a length-I axis."""
        if full != self.intermediate_size:
            raise WeightLoadError(f"intermediate axis of {full}, expected {self.intermediate_size}")
        return slice(self.tp_rank * self.intermediate_per_rank, (self.tp_rank + 1) * self.intermediate_per_rank)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """w13 (weight [E, 2I, H] or bias [E, 2I]), whole or one of its "gate" / "up" halves."""
        local = self.intermediate_per_rank
        if shard_id is None:
            if loaded.dim() < 2 or loaded.shape[1] % 2:
                raise WeightLoadError(f"w13 tensor {tuple(loaded.shape)} has no even gate | up axis")
            half = loaded.shape[1] // 2
            self._load_w13(param, loaded[:, :half], "gate")
            self._load_w13(param, loaded[:, half:], "up")
            return
        if shard_id not in ("gate", "up"):
            raise WeightLoadError(f"w13 shard id must be 'gate' or 'up', not {shard_id!r}")
        rows = self._rows(loaded.shape[1])
        offset = 0 if shard_id == "gate" else local
        copy_checked(param.data[:, offset : offset + local], loaded[:, rows])

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """w2 weight [E, H, I] (this rank's columns of I) or bias [E, H] (whole)."""
        if shard_id is not None:
            raise WeightLoadError(f"w2 takes no shard id (got {shard_id!r})")
        if param.dim() == 2:  # the bias: every rank keeps it, rank 0 adds it (module docstring)
            copy_checked(param.data, loaded)
            return
        copy_checked(param.data, loaded[:, :, self._rows(loaded.shape[-1])])

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] and its routing ([T, K] float32 weights, int32 ids) -> [T, H], summed over ranks."""
        out = fused_moe(
            hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation, self.w13_bias,
            self.w2_bias if self.tp_rank == 0 else None, self.swiglu_limit, self.swiglu_alpha,
        )
        return tp_all_reduce(out, self.tp_size)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_per_rank}/{self.intermediate_size}, act={self.activation}")
