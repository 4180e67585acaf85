"""Linear layers with tensor-parallel sharding and a quantization hook.

A layer never owns its weight directly: it asks its quantization method (unquantized by default) to create
the parameters, then installs its own `weight_loader` on each, which slices a full checkpoint tensor down to
this rank's shard along the axis the method tagged as `output_dim` / `input_dim`.

    ColumnParallel  W [out, in]: rank r holds rows    r*out/tp : (r+1)*out/tp   (output is sharded)
    RowParallel     W [out, in]: rank r holds columns r*in/tp  : (r+1)*in/tp    (input is sharded, sum-reduce)

Column -> Row pairs (qkv -> o, gate_up -> down) need no communication in between; only the Row layer
all-reduces its partial sums (`tp_all_reduce`, pagedllm.distributed.communication).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# tp_all_gather is re-exported for code that imported the collectives from here before they moved.
from pagedllm.distributed.communication import tp_all_gather, tp_all_reduce  # noqa: F401
from pagedllm.layers.dense import DenseConfig
from pagedllm.layers.weight_utils import WeightLoadError, copy_checked, divide, set_weight_attrs
from pagedllm.protocols.model import ModelBuildContext


def _packed(param: nn.Parameter, dim: int, n: int) -> int:
    """`n` output features in `param`'s own units along `dim`.

    A quantized parameter may pack several values into one element along an axis (AWQ's qweight holds 8
    4-bit outputs per int32): it says so with `packed_dim` and `pack_factor`, and fused-piece offsets along
    that axis shrink by the factor.
    """
    if getattr(param, "packed_dim", None) != dim:
        return n
    factor = int(param.pack_factor)  # type: ignore[attr-defined]
    if n % factor:
        raise WeightLoadError(f"{n} features do not fill whole packed elements of {factor}")
    return n // factor


class LinearBase(nn.Module):
    """Shared construction: the quant method creates `weight` (and friends); the layer adds an optional bias.

    `output_partition_sizes` are this rank's output sizes of the fused pieces (one entry when not fused).
    """

    def __init__(
        self,
        ctx: ModelBuildContext,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        prefix: str,
    ) -> None:
        super().__init__()
        self.tp_rank = ctx.tp_rank
        self.tp_size = ctx.tp_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        # A quantization config returns None for a layer it leaves dense (a skip list): the engine's dense
        # method takes it, as it takes every layer of an unquantized model.
        method = ctx.quant_config.get_method(self, prefix) if ctx.quant_config is not None else None
        self.quant_method = method if method is not None else dense_method(ctx, self, prefix)
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes, ctx.dtype)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=ctx.dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, {"output_dim": 0})
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            # A method may load a parameter itself (GGUF: a piece's block type is known only when its tensor
            # arrives); it then asks `piece_index` where a shard goes instead of having the layer slice it.
            if not getattr(param, "method_loads", False):
                set_weight_attrs(param, {"weight_loader": self.weight_loader})

    def piece_index(self, shard_id: Any = None) -> int:
        """Which of `output_partition_sizes` a checkpoint shard fills (0 for an unfused layer)."""
        if shard_id is not None:
            raise WeightLoadError(f"{type(self).__name__} takes no shard id (got {shard_id!r})")
        return 0

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's slice of a full checkpoint tensor into `param`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (small projections, gates)."""

    def __init__(
        self,
        ctx: ModelBuildContext,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__(ctx, input_size, [output_size], bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise WeightLoadError(f"ReplicatedLinear takes no shard id (got {shard_id!r})")
        copy_checked(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of y (no communication)."""

    def __init__(
        self,
        ctx: ModelBuildContext,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__(ctx, input_size, [divide(output_size, ctx.tp_size)], bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise WeightLoadError(f"ColumnParallelLinear takes no shard id (got {shard_id!r})")
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            size = param.data.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections fused along the output axis (gate_proj + up_proj -> gate_up_proj).

    Rank r's parameter is [piece0 shard r | piece1 shard r | ...]; `shard_id` is the piece's index.
    """

    def __init__(
        self,
        ctx: ModelBuildContext,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(ctx, input_size, [divide(s, ctx.tp_size) for s in output_sizes], bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise WeightLoadError(
                f"MergedColumnParallelLinear needs a piece index 0..{len(self.output_sizes) - 1}"
            )
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # a per-layer scalar (e.g. a quant scale) shared by the pieces
            copy_checked(param.data, loaded_weight)
            return
        size = _packed(param, output_dim, self.output_partition_sizes[shard_id])
        offset = _packed(param, output_dim, sum(self.output_partition_sizes[:shard_id]))
        dst = param.data.narrow(output_dim, offset, size)
        copy_checked(dst, loaded_weight.narrow(output_dim, self.tp_rank * size, size))

    def piece_index(self, shard_id: Any = None) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise WeightLoadError(f"MergedColumnParallelLinear needs a piece index (got {shard_id!r})")
        return shard_id


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused, heads split across ranks; `shard_id` is "q", "k" or "v".

    Rank r's parameter is [its q heads | its k heads | its v heads]. With fewer KV heads than ranks, each KV
    head is replicated on tp_size / num_kv_heads consecutive ranks (rank r holds KV head r // replicas).
    """

    def __init__(
        self,
        ctx: ModelBuildContext,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        tp = ctx.tp_size
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp)
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp)
            self.num_kv_head_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp, total_num_kv_heads)
        q_size = self.num_heads * head_size
        kv_size = self.num_kv_heads * head_size
        super().__init__(ctx, hidden_size, [q_size, kv_size, kv_size], bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        pieces = {"q": 0, "k": 1, "v": 2}
        if shard_id not in pieces:
            raise WeightLoadError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v' (got {shard_id!r})")
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            copy_checked(param.data, loaded_weight)
            return
        index = pieces[shard_id]
        size = _packed(param, output_dim, self.output_partition_sizes[index])
        offset = _packed(param, output_dim, sum(self.output_partition_sizes[:index]))
        # q heads are split evenly; a KV head may be shared by several ranks.
        rank_in_piece = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        dst = param.data.narrow(output_dim, offset, size)
        copy_checked(dst, loaded_weight.narrow(output_dim, rank_in_piece * size, size))

    def piece_index(self, shard_id: Any = None) -> int:
        pieces = {"q": 0, "k": 1, "v": 2}
        if shard_id not in pieces:
            raise WeightLoadError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v' (got {shard_id!r})")
        return pieces[shard_id]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed over ranks, then the bias is added."""

    input_is_sharded = True  # read by quant methods whose per-input metadata must then stay whole (GPTQ act-order)

    def __init__(
        self,
        ctx: ModelBuildContext,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__(ctx, divide(input_size, ctx.tp_size), [output_size], bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise WeightLoadError(f"RowParallelLinear takes no shard id (got {shard_id!r})")
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            size = param.data.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)  # the bias (no input_dim) is replicated whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias goes in after the reduction, otherwise it would be counted tp_size times.
        y = tp_all_reduce(self.quant_method.apply(self, x, None), self.tp_size)
        return y + self.bias if self.bias is not None else y


def dense_method(ctx: ModelBuildContext, layer: nn.Module, prefix: str) -> Any:
    """The build's dense method for `layer` (ModelBuildContext.dense_config; torch's matmul without one)."""
    return (ctx.dense_config if ctx.dense_config is not None else DenseConfig()).get_method(layer, prefix)
