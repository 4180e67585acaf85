"""GGUF products of >= COPY_GEMM_ROWS rows on bf16 copies: the MLP's activation handed from GEMM to GEMM in bf16
(GGUFLinearMethod.apply_act_and_mul), against torch's own bf16 MLP on the same dequantized weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from test_quant_gguf import quantized
from torch import nn

from pagedllm.plugins.quantization.gguf.bf16_gemm import bf16_library
from pagedllm.plugins.quantization.gguf.kernels import COPY_GEMM_ROWS, NATIVE_GEMM_ROWS
from pagedllm.plugins.quantization.gguf.method import GGUFConfig


def gguf_linear(config: GGUFConfig, weight: Any) -> nn.Module:
    """One linear layer of `config`'s method, loaded with `weight` (GGUFBlocks, or a dense float tensor)."""
    layer = nn.Module()
    method = config.get_method(layer, "layer")
    rows, cols = weight.shape
    method.create_weights(layer, int(cols), [int(rows)], torch.float32)
    layer.weight.weight_loader(layer.weight, weight)
    method.process_weights_after_loading(layer)
    layer.quant_method = method
    return layer


def test_the_mlp_activation_goes_from_gemm_to_gemm_in_bf16() -> None:
    config = GGUFConfig(batch_gemm="bfloat16")
    rng = np.random.default_rng(11)
    gate_up_blocks = quantized(rng.standard_normal((2 * 64, 96)).astype(np.float32), Q.Q4_1)
    down_blocks = quantized(rng.standard_normal((96, 64)).astype(np.float32), Q.Q8_0)
    gate_up, down = gguf_linear(config, gate_up_blocks), gguf_linear(config, down_blocks)
    x = torch.randn(NATIVE_GEMM_ROWS + 5, 96)

    act = gate_up.quant_method.apply_act_and_mul(gate_up, x, "silu")
    gate, up = F.linear(x.to(torch.bfloat16), gate_up_blocks.dequantize().to(torch.bfloat16)).chunk(2, dim=-1)
    assert act is not None and act.dtype == torch.bfloat16
    if config.cpu_fused_ops() is None:
        assert torch.equal(act, F.silu(gate) * up)  # a bf16 model's MLP (torch's ops) on the same weights
    else:  # cpu_ops.c NOTE 7: silu(gate) * up in float32, rounded to bf16 once (its exp: 1-2 ulp of float32)
        exact = F.silu(gate.float()) * up.float()
        assert ((act.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()
        assert (act == exact.to(torch.bfloat16)).float().mean() > 0.99
    y = down.quant_method.apply(down, act, None)  # the bf16 activation in, the model's float32 out
    assert y.dtype == torch.float32
    w16 = down_blocks.dequantize().to(torch.bfloat16)
    if bf16_library() is None:  # oneDNN's bf16 linear: its bf16 outputs widened (batch_gemm.py NOTE 1)
        assert torch.equal(y, F.linear(act, w16).float())
    else:  # bf16_gemm.c: the float32 sums of the same bf16 products, not rounded to bf16 (its NOTE 2)
        exact = F.linear(act.double(), w16.double())
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-4)
        assert not torch.equal(y, F.linear(act, w16).float())  # finer than the bf16-rounded outputs

    # Decode-sized products and other activations keep the float32 path; the bf16 copy from COPY_GEMM_ROWS
    # rows on, fewer than the float32 path's dequantized GEMM takes (kernels.py NOTE 6).
    assert COPY_GEMM_ROWS < NATIVE_GEMM_ROWS
    assert gate_up.quant_method.apply_act_and_mul(gate_up, x[:COPY_GEMM_ROWS], "silu") is not None
    assert gate_up.quant_method.apply_act_and_mul(gate_up, x[: COPY_GEMM_ROWS - 1], "silu") is None
    assert gate_up.quant_method.apply_act_and_mul(gate_up, x, "gelu_tanh") is None
    # A layer without a bf16 copy (a dense tensor in the file) would answer a bf16 input in bf16: from then on
    # no layer of this model hands its activation over in bf16.
    gguf_linear(config, torch.randn(96, 64))
    assert gate_up.quant_method.apply_act_and_mul(gate_up, x, "silu") is None


def test_float32_batch_gemms_keep_the_float32_activation() -> None:
    config = GGUFConfig(batch_gemm="float32")
    layer = gguf_linear(config, quantized(np.ones((2 * 64, 96), dtype=np.float32), Q.Q4_1))
    assert layer.quant_method.apply_act_and_mul(layer, torch.randn(NATIVE_GEMM_ROWS, 96), "silu") is None
