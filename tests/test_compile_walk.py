"""layers/compile_ahead.repeated_layers_skipped: in a compile-ahead walk, a layer whose call repeats an earlier
layer's returns that output instead of running; a layer that differs in any setting or shape runs; outside the
walk every layer runs and the model is left as it was."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers import compile_ahead


class Impl:
    """A plain object held by a layer (like an attention impl): its numbers take part in the signature."""

    def __init__(self, window: int | None) -> None:
        self.sliding_window = window


class Layer(nn.Module):
    def __init__(self, calls: list[int], idx: int, width: int = 4, window: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.impl = Impl(window)
        self.prefix = f"layers.{idx}"  # a string: left out of the signature
        self.calls, self.layer_idx = calls, idx  # its position: left out too

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(self.layer_idx)
        h = self.proj(x)
        return h, h if residual is None else residual + h


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, meta: Any) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, meta)
        return x


def _walk(model: nn.Module, *steps: tuple[torch.Tensor, Any]) -> None:
    token = compile_ahead._COMPILE_ONLY.set(True)  # what compiling_ahead() sets, without needing triton
    try:
        with compile_ahead.repeated_layers_skipped(model):
            for x, meta in steps:
                model(x, meta)
    finally:
        compile_ahead._COMPILE_ONLY.reset(token)


def test_identical_layers_run_once_per_distinct_call() -> None:
    calls: list[int] = []
    model = Stack([Layer(calls, i) for i in range(6)])
    meta = object()
    _walk(model, (torch.zeros(3, 4), meta), (torch.zeros(3, 4), meta))
    # Layer 0 (no residual) and layer 1 (with one) run; 2-5 repeat layer 1's call. The second step repeats
    # the first's calls exactly (same shapes, same metadata object): nothing runs.
    assert calls == [0, 1]
    calls.clear()
    _walk(model, (torch.zeros(5, 4), meta), (torch.zeros(5, 4), object()))
    assert calls == [0, 1, 0, 1]  # another size, then another step's metadata: each walked once
    calls.clear()
    model(torch.zeros(3, 4), meta)  # outside a walk: every layer, the model's own forwards restored
    assert calls == [0, 1, 2, 3, 4, 5]
    assert all("forward" not in vars(layer) for layer in model.layers)


def test_a_layer_with_other_settings_or_shapes_runs() -> None:
    calls: list[int] = []
    layers = [Layer(calls, 0), Layer(calls, 1), Layer(calls, 2, window=8), Layer(calls, 3), Layer(calls, 4)]
    layers[4].proj.weight.data = layers[4].proj.weight.data.to(torch.float64).to(torch.float32).t().contiguous().t()
    model = Stack(layers)
    _walk(model, (torch.zeros(2, 4), object()))
    # 2 has a window, 3 repeats 1, 4's weight has other strides.
    assert calls == [0, 1, 2, 4]


def test_no_skipping_without_compile_only() -> None:
    calls: list[int] = []
    model = Stack([Layer(calls, i) for i in range(4)])
    with compile_ahead.repeated_layers_skipped(model):
        model(torch.zeros(2, 4), object())
    assert calls == [0, 1, 2, 3]
