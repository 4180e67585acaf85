"""AWQ (GEMM) and GPTQ checkpoints kept packed: layout decoding, tiny-model greedy parity, selection.

The checkpoints are packed by tests/quant_packers.py, written from AutoAWQ's `WQLinear_GEMM.from_linear` and
AutoGPTQ's `QuantLinear.pack` (not from the engine's code). Independently of both:

1. The GPTQ packer's words equal compressed-tensors' `pack_to_int32` (another implementation of the same
   sequential low-bits-first packing) for 2, 4 and 8 bits.
2. The engine's unpacking of AWQ's interleaved nibbles and GPTQ's rows/zeros (v1 z-1 and v2) gives exactly
   the integer-decoded weights; reading AWQ words in plain order does not (the order matters). Sorting
   act-order inputs by group (done at load) only permutes the columns.
3. Tiny random Llama checkpoints (AWQ 4-bit; GPTQ 4-bit sym act-order v1, 8-bit asym v2, 2-bit) give the same
   greedy tokens as transformers' float32 model loaded with the dequantized weights, and the packed layers
   hold ~1/8 (4-bit) of the float32 bytes.
4. A config that cannot be served is refused naming the field.

(The Triton kernel is checked in test_quant_awq_gptq_kernel.py. During development the AWQ packer was also
checked against AutoAWQ 0.2.9's own `dequantize_gemm`, which cannot be installed here for CI.)
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from quant_packers import awq_pack, dense_model, gptq_pack, quantize_rtn, write_quantized_llama
from tiny_models import hf_greedy_with, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.quantization.w4a16.awq import awq_reasons
from pagedllm.plugins.quantization.w4a16.gptq import gptq_reasons
from pagedllm.plugins.quantization.w4a16.layout import (
    PackedLayout,
    dequantize,
    sort_act_order,
    unpack_along_columns,
)
from pagedllm.selector import SelectionError

NEW_TOKENS = 16


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_packer_equals_compressed_tensors(bits: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    ql = quantize_rtn(torch.randn(64, 128), bits, 32, sym=False, act_order=True, min_zero=1)
    qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=True)
    offset = 1 << (bits - 1)  # pack_to_int32 takes signed values and adds this offset itself
    ct_qweight = helpers.pack_to_int32((ql.q - offset).to(torch.int8), bits, packed_dim=0)
    ct_qzeros = helpers.pack_to_int32((ql.z - 1 - offset).to(torch.int8), bits, packed_dim=1)
    assert torch.equal(qweight, ct_qweight) and torch.equal(qzeros, ct_qzeros)


@pytest.mark.parametrize(
    ("kind", "bits", "sym", "act_order", "v1"),
    [("awq", 4, False, False, True), ("gptq", 4, True, True, True), ("gptq", 4, False, False, True),
     ("gptq", 8, False, True, False), ("gptq", 2, False, False, False)],
)
def test_unpacking_equals_integer_decoding(kind: str, bits: int, sym: bool, act_order: bool, v1: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    ql = quantize_rtn(w, bits, 32, sym=sym, act_order=act_order, min_zero=1 if kind == "gptq" and v1 else 0)
    if kind == "awq":
        qweight, qzeros = awq_pack(ql.q, ql.z)
        layout, g_idx = PackedLayout("awq", 4, 32), None
    else:
        qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=v1)
        layout, g_idx = PackedLayout("gptq", bits, 32, zero_offset=1 if v1 else 0), ql.g_idx
    ours = dequantize(layout, qweight, qzeros, ql.s.float(), g_idx)
    assert torch.equal(ours.t(), ql.dense())
    # The quantization is real (the error is a fraction of a step) and the packing order is load-bearing.
    assert 0 < (ours.t() - w).abs().max() < ql.s.float().max()
    if kind == "awq":
        assert not torch.equal(unpack_along_columns(qweight, 4), ql.q)


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_sorting_keeps_the_weights(bits: int) -> None:
    """Sorting act-order inputs by group (what the method does at load) permutes W's columns, nothing else."""
    ql = quantize_rtn(torch.randn(64, 256), bits, 32, sym=False, act_order=True, min_zero=1)
    layout = PackedLayout("gptq", bits, 32, zero_offset=1)
    qweight, qzeros = gptq_pack(ql.q, ql.z, bits)
    sorted_ = sort_act_order(layout, qweight, ql.g_idx)
    assert sorted_ is not None
    sorted_qweight, perm = sorted_
    assert not torch.equal(perm, torch.arange(256))
    assert torch.equal(dequantize(layout, sorted_qweight, qzeros, ql.s.float()), ql.dense().t()[perm])
    uneven = ql.g_idx.clone()
    uneven[0] = (uneven[0] + 1) % 8  # one group one input short: cannot be sorted into equal groups
    assert sort_act_order(layout, qweight, uneven) is None


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 17, 40)]


CHECKPOINTS = {
    "awq4": dict(method="awq", bits=4, group_size=32),
    "gptq4_sym_actorder_v1": dict(method="gptq", bits=4, group_size=32, sym=True, act_order=True, v1=True),
    "gptq8_asym_actorder_v2": dict(method="gptq", bits=8, group_size=64, act_order=True, v1=False),
    "gptq2_asym_v1": dict(method="gptq", bits=2, group_size=32, v1=True),
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_dequantized_float_model(name: str, tiny_root: Path) -> None:
    src = make_tiny_model("llama", tiny_root)
    spec = dict(CHECKPOINTS[name])
    folder = tiny_root / f"packed_{name}"
    dense = write_quantized_llama(src, folder, str(spec.pop("method")), **spec)  # type: ignore[arg-type]
    reference = dense_model(src, dense)
    expected = [hf_greedy_with(reference, p, NEW_TOKENS)[0] for p in _prompts()]

    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=48, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected

    model = llm.engine.parts.model
    assert llm.engine.parts.selections["quantization"].winner.name == CHECKPOINTS[name]["method"]
    packed = [m for m in model.modules() if hasattr(m, "qweight")]
    assert len(packed) == 2 * 4  # qkv, o, gate_up, down per layer
    bits = int(CHECKPOINTS[name]["bits"])  # type: ignore[call-overload]
    for m in packed:
        assert not hasattr(m, "weight")
        k, n = m.input_size_per_partition, m.output_size_per_partition
        assert m.qweight.numel() * 32 == k * n * bits  # the codes stay packed: bits per weight, nothing more


def test_unsupported_configs_are_refused(tiny_root: Path) -> None:
    assert "GEMM" in awq_reasons({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})[0]
    assert "3-bit" in gptq_reasons({"quant_method": "gptq", "bits": 3, "group_size": 128})[0]
    assert "checkpoint_format" in gptq_reasons(
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"})[0]
    src = make_tiny_model("llama", tiny_root)
    folder = tiny_root / "packed_awq_for_refusal"
    write_quantized_llama(src, folder, "awq", 4, 32)
    with pytest.raises(SelectionError, match="gptq.*cannot be used.*quantized with 'awq', not gptq"):
        LLM(str(folder), quantization="gptq")
