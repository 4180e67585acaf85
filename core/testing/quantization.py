"""check_quantization_method: a linear layer's GEMM equals x @ W_deq.T for the dequantized checkpoint weight.

The method is built as the engine builds it: the registered config class's `from_config(quantization_config)`,
then `get_method` for a real linear layer (`ReplicatedLinear`, or `MergedColumnParallelLinear` when the
checkpoint comes as fused pieces, the way q/k/v and gate/up are loaded). Each checkpoint value goes through
the parameter's own `weight_loader` (with the piece's shard id), `process_weights_after_loading` runs once,
and then for several batch sizes (methods often route decode-sized and prompt-sized inputs to different
kernels) the layer's output must equal the reference product within tolerance. Every parameter the method
created must have been fed by the checkpoint.

`dequantized_weight` is what the checkpoint decodes to, [out, in] (per piece when fused): computed by the
plugin author independently of the method -- from the format's definition, or the quantizer's own
dequantization -- not by the code under test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from pagedllm.layers.weight_utils import default_weight_loader
from pagedllm.plugin_spec import PluginKind
from pagedllm.protocols.model import ModelBuildContext
from pagedllm.testing.compare import assert_close
from pagedllm.testing.components import find_spec, manager_or_default

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager

Checkpoint = Mapping[str, Any]  # parameter name -> the checkpoint's tensor (or a format's own object)


@dataclass
class QuantizationReport:
    method: str
    batch_sizes: list[int] = field(default_factory=list)
    max_rel_error: float = 0.0


def check_quantization_method(
    name: str,
    checkpoint: Checkpoint | Sequence[Checkpoint],
    dequantized_weight: torch.Tensor | Sequence[torch.Tensor],
    *,
    quantization_config: Mapping[str, Any] | None = None,
    bias: torch.Tensor | None = None,
    batch_sizes: Sequence[int] = (1, 3, 33),
    rtol: float = 1e-3,
    atol: float = 1e-5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    prefix: str = "model.layers.0.mlp.down_proj",
    seed: int = 0,
    plugin_manager: PluginManager | None = None,
) -> QuantizationReport:
    """Check the quantization method registered as `name` (see the module docstring).

    `checkpoint`: one layer's tensors by parameter name ({"qweight": ..., "scales": ...}), or one such
    mapping per fused piece (then `dequantized_weight` is one [out_i, in] tensor per piece). `rtol`/`atol`
    bound max|y - y_ref| by atol + rtol * max|y_ref| (a method may round activations: loosen them for it).
    """
    pm = manager_or_default(plugin_manager)
    spec = find_spec(PluginKind.QUANTIZATION, name, pm)
    qc = dict(quantization_config) if quantization_config is not None else None
    reasons = spec.reasons_against(qc)
    if reasons:
        raise AssertionError(f"quantization method {name!r} refuses {qc}: {'; '.join(reasons)}")
    config = spec.resolve().from_config(qc)
    device = torch.device(device)

    pieces = [checkpoint] if isinstance(checkpoint, Mapping) else list(checkpoint)
    weights = [dequantized_weight] if isinstance(dequantized_weight, torch.Tensor) else list(dequantized_weight)
    if len(pieces) != len(weights):
        raise ValueError(f"{len(pieces)} checkpoint pieces but {len(weights)} dequantized weights")
    in_features = weights[0].shape[1]
    out_sizes = [w.shape[0] for w in weights]
    fused = not isinstance(checkpoint, Mapping)
    layer = _build_layer(config, in_features, out_sizes, fused, bias is not None, prefix, dtype, device)
    label = f"quantization method {name!r} ({type(layer.quant_method).__name__} on a {type(layer).__name__} " \
            f"{in_features} -> {out_sizes})"

    params = dict(layer.named_parameters())
    fed: set[str] = set()
    for shard, piece in enumerate(pieces):
        for pname, value in piece.items():
            param = params.get(pname)
            if param is None:
                raise AssertionError(f"{label}: the checkpoint has {pname!r}, but the method created only "
                                     f"{sorted(params)}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            if fused:
                loader(param, value, shard)
            else:
                loader(param, value)
            fed.add(pname)
    if bias is not None:  # the layer's own parameter, not the method's: copied in directly
        with torch.no_grad():
            params["bias"].copy_(bias)
        fed.add("bias")
    unfed = sorted(set(params) - fed)
    if unfed:
        raise AssertionError(f"{label}: parameters {unfed} were never loaded from the checkpoint")
    layer.quant_method.process_weights_after_loading(layer)

    w_ref = torch.cat([w.float() for w in weights]).to(device)
    report = QuantizationReport(name)
    gen = torch.Generator().manual_seed(seed)
    for m in batch_sizes:
        x = torch.randn(m, in_features, generator=gen).to(device=device, dtype=dtype)
        ref = x.float() @ w_ref.T
        if bias is not None:
            ref = ref + bias.float().to(device)
        with torch.no_grad():
            y = layer(x)
        if y.dtype != dtype:
            raise AssertionError(f"{label}: output dtype {y.dtype} for {dtype} activations")
        rel = assert_close(y, ref, rtol=rtol, atol=atol, what=f"{label}, {m} rows: x @ W^T")
        report.max_rel_error = max(report.max_rel_error, rel)
        report.batch_sizes.append(m)
    return report


def _build_layer(
    config: Any, in_features: int, out_sizes: list[int], fused: bool, has_bias: bool, prefix: str,
    dtype: torch.dtype, device: torch.device,
) -> Any:
    """A real linear layer whose method the config hands out, built as the engine builds models."""
    ctx = ModelBuildContext(None, dtype, device, None, config, block_size=16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            if fused:
                return MergedColumnParallelLinear(ctx, in_features, out_sizes, bias=has_bias, prefix=prefix)
            return ReplicatedLinear(ctx, in_features, out_sizes[0], bias=has_bias, prefix=prefix)
    finally:
        torch.set_default_dtype(previous)
