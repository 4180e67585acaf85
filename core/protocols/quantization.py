"""Quantization method protocol: how a linear layer stores its weights and multiplies by them.

Linear layers (pagedllm.layers.linear) never own parameters directly: they ask their method to create them,
so an AWQ or GGUF method can register packed tensors under the checkpoint's names and a fast matmul.

Optional: `apply_act_and_mul(layer, x, activation) -> Tensor | None` on a method of a fused [gate | up] layer
returns act(gate) * up of x's product in one go (activation "silu" or "gelu_tanh"), or None to decline; the
gated MLPs ask through pagedllm.layers.activation.fused_gate_up_act before running apply and the activation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class QuantizationMethod(Protocol):
    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's parameters (e.g. `weight`) with a `weight_loader` attribute on each."""
        ...

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W^T (+ bias) with the layer's stored weights."""
        ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or transpose once, after every weight of the layer is loaded."""
        ...


class RowMatmulMethod(Protocol):
    """An optional member of a method whose one-row product can run with its pointers bound once.

    A model's per-step plan (the llama plugin's CPU decode) calls the bound function every step on the same
    buffers instead of `apply`; a method without it, or returning None for a layer, keeps `apply`.
    """

    def bind_row_matmul(
        self, layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor
    ) -> Callable[[int], None] | None:
        """A call (taking a thread count) that writes layer(x) for the one row x [1, K] into out [1, N]."""
        ...

    # Optional too: `row_matmul_c_calls(layer, x, out) -> list[tuple[int, ...]] | None`, the same product as
    # plain C calls (function address, type, weights, n, k, x, y), each function with the gguf plugin's
    # gguf_matmul signature, for a plan that runs its whole step in C (CpuFusedOps.bind_decode_step).


class CpuFusedOps(Protocol):
    """The CPU's fused C kernels a quantization method may bring (its config's optional `cpu_fused_ops()`):
    float32 CPU tensors only, not bit-identical to torch. Layers call its tensor wrappers (`add_rms_norm`,
    `rotary_neox`, `silu_and_mul`, `decode_attention`: see the gguf plugin's cpu_ops.py); a model's per-step
    plan (the llama plugin's CPU decode) binds pointers once and calls the C functions below directly."""

    norm_fn: Any  # cpu_add_rms_norm(x, residual, w, eps, gemma, rows, h, out, residual_out)
    rotary_fn: Any  # cpu_rotary_neox(q, q_row, q_heads, k, k_row, k_heads, head, rows, pos, cos, sin, half)
    silu_fn: Any  # cpu_silu_and_mul(x, rows, d, out)
    attn_fn: Any  # cpu_decode_attention(..., threads, kv_bf16): write each decode's K/V row, then attend (0, or an
    # error code); kv_bf16 = the cache holds bf16 (the queries and outputs stay float32)
    # Optional: `bind_decode_step(spec) -> Callable`, a Llama model's whole one-token decode step as one C call
    # (the gguf plugin's cpu_ops.py documents the spec: per layer the norms, attention parameters, KV cache and
    # each linear's `row_matmul_c_calls`; the scratch buffers and shapes).


class QuantizationConfig(Protocol):
    """A checkpoint's (or the config's) quantization choice; hands out a method per layer."""

    name: str

    def get_method(self, layer: torch.nn.Module, prefix: str) -> QuantizationMethod | None:
        """The method for `layer`, or None to leave it dense (the engine's dense method then takes it).

        Optional members: `get_embedding_method(layer)` (pagedllm.layers.embedding), `cpu_fused_ops()` -> a
        CpuFusedOps or None (the CPU's fused C kernels for this method's float32 models).
        """
        ...
