"""The linear method shared by AWQ and GPTQ: the checkpoint's packed tensors stay resident as they are.

Parameters carry the checkpoint's names (`qweight`, `qzeros`, `scales`, GPTQ's `g_idx`) and layout (see
w4a16/layout.py); their `output_dim` / `input_dim` / `packed_dim` / `pack_factor` attributes let the layer's
loader place fused pieces and tensor-parallel shards without knowing the format.

    after loading   AWQ's codes are repacked into the GPTQ order (same bytes); act-order inputs are sorted
    apply on CUDA   Triton kernels dequantize in registers: a GEMV for <= 8 rows (w4a16/gemv.py), the GEMM
                    (w4a16/kernel.py) up to 127 rows; from 128 rows the weight is dequantized into a per-call
                    16-bit scratch and cuBLAS multiplies (w4a16/dequant.py)
    apply elsewhere dequantize-then-matmul in torch, per call: the weight stays 4-bit (2/8-bit) in memory
    apply_act_and_mul  a fused [gate | up] layer at decode: the tensor-core GEMV forms silu(gate) * up in its
                    epilogue (w4a16_mma.cu NOTE 5), one launch and one [M, 2I] round trip fewer per layer
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.api.model import WeightLoadError, copy_checked, set_weight_attrs
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout, awq_to_gptq, dequantize, sort_act_order


def _param(data: torch.Tensor, **attrs: Any) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    set_weight_attrs(param, attrs)
    return param


class PackedIntLinearMethod:
    """QuantizationMethod for AWQ GEMM / GPTQ layers; `desc_act` says g_idx may not be k // group_size."""

    def __init__(self, layout: PackedLayout, desc_act: bool = False) -> None:
        self.layout = layout
        self.desc_act = desc_act

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        lay = self.layout
        k, n, pf = input_size_per_partition, sum(output_partition_sizes), lay.pack_factor
        tp_size = getattr(layer, "tp_size", 1)
        group = lay.group_size if lay.group_size > 0 else k
        if lay.group_size <= 0 and tp_size > 1:
            raise ValueError("gptq: group_size -1 (one group per row) with tensor parallelism is not supported")
        # NOTE: with act-order, g_idx names groups of the whole input and a row-parallel shard's inputs may
        # belong to any of them: every rank then keeps the whole scales and zeros (not split along the input,
        # as vLLM's GPTQ does) and its own slice of g_idx, looked up per input (the shard's groups are not
        # group_size runs, so sort_act_order declines).
        whole_groups = self.desc_act and tp_size > 1 and getattr(layer, "input_is_sharded", False)
        if k % group:
            raise ValueError(f"{lay.kind}: input size {k} is not a multiple of group_size {group}")
        for size in output_partition_sizes:
            if size % pf:
                raise ValueError(f"{lay.kind}: output size {size} is not a multiple of the pack factor {pf}")
        if lay.kind == "gptq" and k % pf:
            raise ValueError(f"gptq: input size {k} is not a multiple of the pack factor {pf}")
        self._group = group
        groups = k * tp_size // group if whole_groups else k // group
        in_dim = None if whole_groups else 0  # the loader narrows tensors along input_dim; None loads whole
        if lay.kind == "awq":
            qweight = _param(torch.empty(k, n // pf, dtype=torch.int32),
                             input_dim=0, output_dim=1, packed_dim=1, pack_factor=pf)
        else:
            qweight = _param(torch.empty(k // pf, n, dtype=torch.int32),
                             input_dim=0, output_dim=1, packed_dim=0, pack_factor=pf)
        qzeros = _param(torch.empty(groups, n // pf, dtype=torch.int32),
                        input_dim=in_dim, output_dim=1, packed_dim=1, pack_factor=pf, dummy_fill=self._midpoint_zeros)
        # float16 in the checkpoint; held in the model dtype (exact for float32, the CPU dtype).
        scales = _param(torch.empty(groups, n, dtype=params_dtype), input_dim=in_dim, output_dim=1)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        if lay.kind == "gptq":
            g_idx = _param(torch.empty(k, dtype=torch.int32), method_loads=True, dummy_fill=self._plain_g_idx)
            set_weight_attrs(g_idx, {"weight_loader": self._g_idx_loader(layer, 0 if whole_groups else group)})
            layer.register_parameter("g_idx", g_idx)
            layer.__dict__["g_idx_seen"] = False

    def _midpoint_zeros(self, qzeros: torch.Tensor, generator: torch.Generator) -> None:
        """Dummy weights (loaders/dummy_loader.py): every zero point at the format's midpoint 2^(bits-1),
        as a symmetric checkpoint stores it (v1: minus one), so the random codes give zero-mean weights."""
        lay = self.layout
        zero = (1 << (lay.bits - 1)) - lay.zero_offset
        word = sum(zero << (i * lay.bits) for i in range(lay.pack_factor))
        qzeros.fill_(word - (1 << 32) if word >= 1 << 31 else word)  # the same 32 bits, signed

    def _plain_g_idx(self, g_idx: torch.Tensor, generator: torch.Generator) -> None:
        """Dummy weights: input k in group k // group_size (no act-order), as a desc_act false checkpoint."""
        k = g_idx.shape[0]
        group = self.layout.group_size if self.layout.group_size > 0 else k
        torch.div(torch.arange(k, device=g_idx.device, dtype=torch.int32), group, rounding_mode="floor", out=g_idx)

    @staticmethod
    def _g_idx_loader(layer: nn.Module, renumber_group: int) -> Any:
        """Every fused piece sends its g_idx: they must agree (one input, so one act-order permutation).

        A row-parallel shard takes its slice; without act-order (`renumber_group` = group_size) its scales and
        zeros hold only its own k / group groups, so the global group numbers are shifted to start at 0;
        with act-order (0) the tables stay whole and so do the numbers (create_weights NOTE)."""

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            k = param.shape[0]
            if loaded.shape[0] != k:
                start = getattr(layer, "tp_rank", 0) * k
                loaded = loaded.narrow(0, start, k)
                if renumber_group:
                    loaded = loaded - start // renumber_group
            if layer.__dict__["g_idx_seen"]:
                if not torch.equal(param.data, loaded.to(param.dtype)):
                    raise WeightLoadError(
                        f"g_idx of piece {shard_id!r} differs from the fused layer's other pieces; "
                        "fused projections must share one act-order permutation"
                    )
                return
            copy_checked(param.data, loaded)
            layer.__dict__["g_idx_seen"] = True

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        g_idx = cast(torch.Tensor | None, getattr(layer, "g_idx", None))
        layout = PackedLayout(self.layout.kind, self.layout.bits, self._group, self.layout.zero_offset)
        if layout.kind == "awq":
            # NOTE: AWQ's codes are repacked once into the GPTQ order (inputs along K, zeros in order), the
            # layout the decode GEMV streams; same bytes. The loader attributes of qweight describe the
            # checkpoint's packing and are not used after loading.
            qweight, qzeros = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.qzeros)
            layout, qweight.data, qzeros.data = awq_to_gptq(layout, qweight.data, qzeros.data)
        layer.__dict__["w4a16_layout"] = layout
        act_order, perm = None, None
        if g_idx is not None:
            trivial = torch.arange(g_idx.shape[0], device=g_idx.device, dtype=g_idx.dtype) // self._group
            # NOTE: g_idx equal to k // group_size carries no information: the kernel computes it instead.
            act_order = None if torch.equal(g_idx, trivial) else g_idx
        if act_order is not None:
            # Act-order: sort the inputs by group once, permute x per call (a gather of one row of K), and
            # the kernel reads zeros and scales a row at a time again (10x faster than per-input lookups).
            lay = layer.__dict__["w4a16_layout"]
            qweight = cast(torch.Tensor, layer.qweight)
            sorted_ = sort_act_order(lay, qweight.data, act_order)
            if sorted_ is not None:
                qweight.data, perm = sorted_
                act_order = None
        layer.__dict__["w4a16_g_idx"] = act_order
        layer.register_buffer("w4a16_perm", perm)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lay: PackedLayout = layer.__dict__["w4a16_layout"]
        g_idx: torch.Tensor | None = layer.__dict__["w4a16_g_idx"]
        perm = cast(torch.Tensor | None, layer.w4a16_perm)
        if perm is not None:
            x = x.index_select(-1, perm)
        qweight, qzeros, scales = (cast(torch.Tensor, getattr(layer, n)) for n in ("qweight", "qzeros", "scales"))
        if x.is_cuda:
            from pagedllm.plugins.quantization.w4a16.kernel import w4a16_matmul

            y = w4a16_matmul(x, lay, qweight, qzeros, scales, g_idx, scales.shape[1])
            return y + bias if bias is not None else y
        w_t = dequantize(lay, qweight, qzeros, scales, g_idx, dtype=x.dtype)  # [K, N]
        return F.linear(x, w_t.t(), bias)

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """act(gate) * up of this [gate | up] layer in one kernel, or None (the caller runs apply and the
        activation): CUDA, "silu", no bias, decode-sized rows on the tensor-core GEMV (core/protocols/quantization.py)."""
        if activation != "silu" or not x.is_cuda or getattr(layer, "bias", None) is not None:
            return None
        from pagedllm.plugins.quantization.w4a16 import mma as mma
        from pagedllm.plugins.quantization.w4a16.gemv import gemv_variant
        from pagedllm.plugins.quantization.w4a16.kernel import w4a16_route

        lay: PackedLayout = layer.__dict__["w4a16_layout"]
        k = x.shape[-1]
        if w4a16_route(lay, x.numel() // k if k else 0, layer.__dict__["w4a16_g_idx"]) != "gemv" or gemv_variant() != "mma":
            return None
        perm = cast(torch.Tensor | None, layer.w4a16_perm)
        if perm is not None:
            x = x.index_select(-1, perm)
        qweight, qzeros, scales = (cast(torch.Tensor, getattr(layer, n)) for n in ("qweight", "qzeros", "scales"))
        n = scales.shape[1]
        if not mma.usable(lay, x.reshape(-1, k), scales, qweight, n, gated=True):
            return None
        return mma.w4a16_mma_gemv(x, lay, qweight, qzeros, scales, n, gated=True)
