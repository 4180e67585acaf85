"""`load_format: dummy` with a quantized config: the method's own parameters, filled with valid random contents.

A config.json alone (a tiny Llama plus a GPTQ, AWQ or GGUF quantization_config, no weights) must build the
kept-quantized model: the packed tensors in the format's shapes and dtypes, codes that use every value, zero
points at the format's midpoint, no act-order, and finite logits through the engine. What the tensors decode
to is checked with the layouts' torch reference (w4a16_layout.dequantize) and, for GGUF, with gguf-py's own
numpy dequantization, not with the dummy loader's code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.quantization.w4a16.layout import PackedLayout, dequantize, unpack_codes

GROUP = 32  # the tiny model's hidden size is 64: two groups per row

QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
}


def _config_dir(root: Path, quantization_config: dict[str, Any]) -> str:
    path = root / str(quantization_config["quant_method"])
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config("llama").to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _llm(path: str) -> LLM:
    return LLM(path, load_format="dummy", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)


def _generate_finite(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}], params, use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.token_ids) == 6
    assert completion.logprobs is not None
    for step in completion.logprobs:
        assert all(math.isfinite(lp.logprob) for lp in step.values())


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_dummy_w4a16_params_are_valid_random_codes(kind: str, tmp_path: Path) -> None:
    with _llm(_config_dir(tmp_path, QUANT_CONFIGS[kind])) as llm:
        model = llm.engine.parts.model
        layer = model.get_submodule("model.layers.1.mlp.gate_up_proj")
        k, n = 64, 2 * 128  # hidden -> gate and up
        lay: PackedLayout = layer.__dict__["w4a16_layout"]
        # Both formats end in the GPTQ order (AWQ is repacked at load): inputs along K in the words.
        assert (lay.kind, lay.bits, lay.group_size) == ("gptq", 4, GROUP)
        assert layer.qweight.dtype == torch.int32 and tuple(layer.qweight.shape) == (k // 8, n)
        assert layer.qzeros.dtype == torch.int32 and tuple(layer.qzeros.shape) == (k // GROUP, n // 8)
        assert layer.scales.dtype == torch.float32 and tuple(layer.scales.shape) == (k // GROUP, n)
        if kind == "gptq":
            assert tuple(layer.g_idx.shape) == (k,)
            assert torch.equal(layer.g_idx.long(), torch.arange(k) // GROUP)  # no act-order
        assert layer.__dict__["w4a16_g_idx"] is None and layer.w4a16_perm is None
        q, z = unpack_codes(lay, layer.qweight, layer.qzeros)
        assert torch.equal(torch.unique(q), torch.arange(16, dtype=q.dtype))  # every code drawn
        assert bool((z == 8).all())  # the 4-bit midpoint (GPTQ v1 stores 7)
        w = dequantize(lay, layer.qweight, layer.qzeros, layer.scales)
        assert bool(torch.isfinite(w).all()) and 0 < float(w.abs().max()) <= 8e-3
        _generate_finite(llm)


def test_dummy_w4a16_seeded_and_created_quantized(tmp_path: Path) -> None:
    """Two builds draw the same codes; the linear layers hold no dense weight at all."""
    path = _config_dir(tmp_path, QUANT_CONFIGS["gptq"])
    states = []
    for _ in range(2):
        with _llm(path) as llm:
            model = llm.engine.parts.model
            assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
            states.append({name: t.clone() for name, t in model.state_dict().items()})
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_random_gguf_blocks_decode_to_small_finite_weights(name: str) -> None:
    """gguf-py (the reference) dequantizes the random blocks to finite, small, non-constant weights."""
    import gguf
    import numpy as np

    from pagedllm.formats.gguf_blocks import Q, random_blocks

    t = Q[name]
    blocks = random_blocks(t, 8, 512, torch.Generator().manual_seed(0), torch.device("cpu"))
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    assert blocks.data.dtype == torch.uint8 and tuple(blocks.data.shape) == (8, 512 // block * type_size)
    w = gguf.quants.dequantize(blocks.data.numpy(), t)
    assert w.shape == (8, 512) and np.isfinite(w).all()
    # Q4_0: |w| <= 8 x 2^-10; the K-quants multiply by 6- or 8-bit sub-scales (Q6_K: up to 128 x 32 x d).
    assert 0 < np.abs(w).max() <= (8 * 2**-10 if name == "Q4_0" else 4.0) and np.unique(w).size > 100


def test_dummy_gguf_runs_kept_quantized(tmp_path: Path) -> None:
    """A config with quant_method gguf builds every linear, the embedding and the LM head from random Q4_0
    blocks (no dense weight is kept), and the tokens' logits stay finite."""
    qc = {"quant_method": "gguf", "dummy_type": "Q4_0"}
    with _llm(_config_dir(tmp_path, qc)) as llm:
        model = llm.engine.parts.model
        assert llm.engine.parts.selections["quantization"].winner.name == "gguf"
        layer = model.get_submodule("model.layers.0.self_attn.qkv_proj")
        assert "gguf_run" in layer.__dict__ and not any(p.numel() for p in layer.parameters())
        _generate_finite(llm)


def test_dummy_awq_tp_shards_are_slices_of_the_tp1_weights(tmp_path: Path) -> None:
    """With tensor parallelism each rank's packed tensors decode to its slice of the tp=1 dummy weights: the
    fused pieces are cut in packed units (AWQ's qweight holds 8 outputs per word) and g_idx-free groups line up."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.builder import build_engine_parts

    # No group is joined here: the build's one collective (world_min of the KV blocks) is the identity.
    base = dict(model=_config_dir(tmp_path, QUANT_CONFIGS["awq"]), device="cpu", loader={"name": "dummy"},
                kv_cache={"num_blocks": 4})

    def weights(parts: Any, name: str) -> torch.Tensor:
        layer = parts.model.get_submodule(name)
        return dequantize(layer.__dict__["w4a16_layout"], layer.qweight, layer.qzeros, layer.scales)

    full = build_engine_parts(EngineConfig.from_dict(base))
    shards = [build_engine_parts(EngineConfig.from_dict({**base, "parallel": {"tensor_parallel_size": 2}}),
                                 tp_rank=rank) for rank in (0, 1)]
    gate_up = "model.layers.0.mlp.gate_up_proj"  # column-parallel, two pieces of 128 outputs
    w = weights(full, gate_up)
    for rank, parts in enumerate(shards):
        mine = weights(parts, gate_up)
        assert torch.equal(mine[:, :64], w[:, rank * 64 : (rank + 1) * 64])  # gate
        assert torch.equal(mine[:, 64:], w[:, 128 + rank * 64 : 128 + (rank + 1) * 64])  # up
    down = "model.layers.1.mlp.down_proj"  # row-parallel: inputs split
    assert torch.equal(torch.cat([weights(p, down) for p in shards]), weights(full, down))


def test_w4a16_routes_decode_to_the_gemv_and_large_batches_to_cublas() -> None:
    """w4a16_matmul's choice by rows for the bench's formats (GPTQ group 128, AWQ repacked to the GPTQ order):
    the GEMV up to 8 rows, the tensor-core GEMV in 8-row slices to 16, the tensor-core GEMM to 64 (to 128 on a
    layer of >= 2^25 weights; kernel.py NOTE 7), dequantize + cuBLAS from there; act-order kept unsorted never
    takes the GEMV or the tensor-core kernels. In a child process: triton is imported by the route's module (see
    test_quant_w4a16_dequant.py for why the parent process keeps it unimported)."""
    code = (
        "import json, torch\n"
        "from pagedllm.plugins.quantization.w4a16.kernel import w4a16_route\n"
        "from pagedllm.plugins.quantization.w4a16.layout import PackedLayout\n"
        "lay = PackedLayout('gptq', 4, 128, 1)\n"
        "ms = [1, 2, 4, 8, 9, 16, 17, 64, 65, 127, 128, 512, 16384]\n"
        "g = torch.zeros(4096, dtype=torch.int32)\n"
        "shaped = [w4a16_route(lay, m, None, n, 132, k) for m, n, k in\n"
        "          ((128, 28672, 4096), (129, 28672, 4096), (128, 4096, 14336), (128, 6144, 4096), (96, 4096, 4096))]\n"
        "wide = [w4a16_route(lay, m, None, n, 132) for m, n in ((128, 28672), (129, 28672), (96, 6144))]\n"
        "print(json.dumps({'plain': [w4a16_route(lay, m) for m in ms], 'act_order': w4a16_route(lay, 1, g),\n"
        "                  'shaped': shaped, 'wide': wide, 'wide_act_order': w4a16_route(lay, 64, g, 28672, 132),\n"
        "                  'awq_order': w4a16_route(PackedLayout('awq', 4, 128), 64)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    routes = json.loads(out.stdout.strip().splitlines()[-1])
    assert routes["plain"] == ["gemv"] * 4 + ["mma_rows"] * 2 + ["mma_gemm"] * 2 + ["dequant"] * 5
    assert routes["act_order"] == "gemm" and routes["awq_order"] == "dequant"
    # NOTE 7: the tensor-core GEMM to 128 rows on gate_up / down of an 8B layer, not on qkv / o
    assert routes["shaped"] == ["mma_gemm", "dequant", "mma_gemm", "dequant", "dequant"]
    # NOTE 6 past the tensor-core GEMM's rows (or where it does not run): a layer of >= 128 x SMs columns keeps
    # the Triton GEMM to 128 rows; act-order never does
    assert routes["wide"] == ["gemm", "dequant", "dequant"] and routes["wide_act_order"] == "dequant"
