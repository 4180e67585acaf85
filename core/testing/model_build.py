"""Building an engine model from a config, as the engine's builder does, without the rest of the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedllm.plugin_spec import PluginKind
from pagedllm.protocols.model import ModelBuildContext
from pagedllm.testing.components import find_spec

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager


def model_class(hf_config: Any, pm: PluginManager) -> Any:
    """The registered model class for the config's first registered `architectures` name."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if pm.get(PluginKind.MODEL, arch) is not None:
            return find_spec(PluginKind.MODEL, arch, pm).resolve()
    raise AssertionError(f"no model is registered for architectures {archs}")


def build_model(
    hf_config: Any,
    pm: PluginManager,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quant_config: Any = None,
    block_size: int = 16,
    poison: bool = True,
) -> Any:
    """The model as the engine builds it (default dtype and device set while it is constructed).

    `poison` fills every floating-point parameter with NaN afterwards, so one a loader never fills is seen.
    """
    device = torch.device(device)
    backend = find_spec(PluginKind.ATTENTION, "torch", pm).resolve()
    ctx = ModelBuildContext(hf_config, dtype, device, backend, quant_config, block_size)
    cls = model_class(hf_config, pm)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = cls(ctx)
    finally:
        torch.set_default_dtype(previous)
    if poison:
        with torch.no_grad():
            for param in model.parameters():
                if param.is_floating_point():
                    param.fill_(float("nan"))
    return model
