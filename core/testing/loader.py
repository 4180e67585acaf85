"""check_loader: the tensors a loader puts into a model equal those of a reference checkpoint.

The loader reads `model_ref` (load_info, then load_weights into a freshly built engine model whose
floating-point parameters start as NaN). The reference is a plain state dict in Hugging Face naming -- e.g. the
safetensors file read directly, or the weights a GGUF file was written from -- loaded into a second model of
the same config through the model's own `load_weights`. Both models must then hold identical tensors, name by
name (fused q/k/v and gate/up included), and no parameter may be left unfilled. Comparing models, not name
maps, keeps the check independent of how the loader names or streams its tensors.

Without a reference (a loader of random weights) the check asks what can be asked: every parameter filled
with finite values, and the same weights on a second load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.plugin_spec import PluginKind
from pagedllm.testing.components import find_spec, manager_or_default
from pagedllm.testing.model_build import build_model

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager


@dataclass
class LoaderReport:
    loader: str
    architecture: str
    tensors_compared: int = 0
    max_abs_error: float = 0.0


def check_loader(
    name: str,
    model_ref: str,
    reference_state_dict: Mapping[str, torch.Tensor] | None = None,
    *,
    atol: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    plugin_manager: PluginManager | None = None,
) -> LoaderReport:
    """Check the loader registered as `name` on `model_ref` (see the module docstring).

    `atol` is the largest difference allowed per element (0: bit-identical; the reference should be what
    the file decodes to, e.g. a quantized tensor's dequantization).
    """
    pm = manager_or_default(plugin_manager)
    spec = find_spec(PluginKind.LOADER, name, pm)
    reasons = spec.reasons_against(model_ref)
    if reasons:
        raise AssertionError(f"loader {name!r} refuses {model_ref!r}: {'; '.join(reasons)}")
    loader = spec.resolve()()
    info = loader.load_info(model_ref)
    archs = list(getattr(info.hf_config, "architectures", None) or [])
    if not archs:
        raise AssertionError(f"loader {name!r}: load_info({model_ref!r}) gave a config without `architectures`")
    report = LoaderReport(name, archs[0])

    got = build_model(info.hf_config, pm, dtype=dtype, device=device)
    loader.load_weights(got, model_ref, info)
    _assert_filled(got, f"loader {name!r} on {model_ref!r}")
    if reference_state_dict is None:
        again = build_model(info.hf_config, pm, dtype=dtype, device=device)
        loader.load_weights(again, model_ref, info)
        _assert_same(got, again, 0.0, f"loader {name!r} on {model_ref!r}: a second load", report)
        return report
    expected = build_model(info.hf_config, pm, dtype=dtype, device=device)
    expected.load_weights(iter(reference_state_dict.items()))
    _assert_filled(expected, f"the reference state dict for {model_ref!r}")
    _assert_same(got, expected, atol, f"loader {name!r} on {model_ref!r}", report)
    return report


def _assert_filled(model: Any, what: str) -> None:
    unfilled = [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if unfilled:
        raise AssertionError(f"{what}: {len(unfilled)} parameters hold NaN/inf after loading (never filled?): "
                             f"{', '.join(unfilled[:8])}")


def _assert_same(got: Any, expected: Any, atol: float, what: str, report: LoaderReport) -> None:
    mine, theirs = got.state_dict(), expected.state_dict()
    if set(mine) != set(theirs):
        raise AssertionError(f"{what}: parameter names differ: {sorted(set(mine) ^ set(theirs))[:8]}")
    wrong = []
    for key, tensor in mine.items():
        ref = theirs[key]
        if tensor.shape != ref.shape or tensor.dtype != ref.dtype:
            wrong.append(f"{key}: {tuple(tensor.shape)} {tensor.dtype} vs {tuple(ref.shape)} {ref.dtype}")
            continue
        if not tensor.is_floating_point():
            if not torch.equal(tensor, ref):
                wrong.append(f"{key}: integer tensor differs")
            continue
        err = float((tensor.float() - ref.float()).abs().max()) if tensor.numel() else 0.0
        report.max_abs_error = max(report.max_abs_error, err)
        report.tensors_compared += 1
        if err > atol:
            wrong.append(f"{key}: max |got - expected| = {err:.3g}")
    if wrong:
        raise AssertionError(f"{what}: {len(wrong)} tensors differ from the reference (allowed {atol:g}): "
                             + "; ".join(wrong[:6]))
