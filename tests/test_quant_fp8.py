"""FP8 quantization: compressed-tensors float-quantized checkpoints, `quant_method: fp8`, and on-the-fly fp8.

Checkpoints are made by the `compressed-tensors` package itself (its preset schemes, its scale calculation and
its FloatQuantizationCompressor), and its own `dequantize` is the reference:

1. Our resident weights (fp8 codes x row scale) equal compressed-tensors' dequantization exactly, for
   per-channel (FP8_DYNAMIC) and per-tensor (FP8, static activations) schemes, fused pieces included.
2. Greedy tokens equal transformers' float32 model loaded with those dequantized weights (the CPU path is
   weight-only: activations are not quantized off Hopper, see fp8/method.py).
3. The same bytes under `quant_method: fp8` (per-tensor scalar scales, static input scales) load and match.
4. `quantization: fp8` on a float checkpoint: our codes and scales equal compressed-tensors quantizing the
   same weights per channel (within one e4m3 step where the two divisions round differently), and greedy
   tokens equal the float model with those weights.
5. Unsupported configs are refused with the field named.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy_with, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.quantization.fp8 import fp8_reasons
from pagedllm.plugins.quantization.fp8.compressed_tensors import compressed_tensors_reasons
from pagedllm.selector import SelectionError

ct = pytest.importorskip("compressed_tensors")

NEW_TOKENS = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 17)]


def ct_checkpoint(src: str, out: Path, preset: str) -> None:
    """Quantize the float model in `src` with compressed-tensors' `preset` and save it compressed to `out`."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    if (out / "config.json").exists():
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        args = module.quantization_scheme.weights
        w = module.weight.data
        per_channel = args.strategy == "channel"
        lo = w.amin(dim=1, keepdim=True) if per_channel else w.amin().reshape(1)
        hi = w.amax(dim=1, keepdim=True) if per_channel else w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)  # the package's own scale choice
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero)
        if hasattr(module, "input_scale"):  # static activations: any calibrated value (unused on the CPU)
            module.input_scale.data.fill_(0.02)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out, safe_serialization=True)
    compressor.update_config(str(out))


def ct_dense(folder: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantization of every quantized weight in `folder` (float32)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    state = load_file(str(folder / "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            dense[name] = dequantize(t, state[name.replace(".weight", ".weight_scale")], args=args, dtype=torch.float32)
        elif not name.endswith(("_scale", "_zero_point")):
            dense[name] = t.float()
    return dense


def reference_tokens(src: str, dense: dict[str, torch.Tensor]) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.load_state_dict(dense, strict=True)
    return [hf_greedy_with(model, p, NEW_TOKENS)[0] for p in _prompts()]


def run(folder: str, **kwargs: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(folder, block_size=4, max_num_batched_tokens=48, num_kv_blocks=128, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def our_dense(llm: LLM) -> dict[str, torch.Tensor]:
    """Each fp8 layer's effective weight, split back into the checkpoint's pieces."""
    out = {}
    for name, module in llm.engine.parts.model.named_modules():
        if not hasattr(module, "fp8_row_scale"):
            continue
        w = module.weight.float() * module.fp8_row_scale.unsqueeze(1)
        last = name.rsplit(".", 1)[1]
        pieces = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(last, (last,))
        for piece, part in zip(pieces, w.split(module.output_partition_sizes)):
            out[f"{name.rsplit('.', 1)[0]}.{piece}.weight"] = part
    return out


@pytest.fixture(scope="module")
def src(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])
def test_compressed_tensors_fp8(src: str, tiny_root: Path, preset: str) -> None:
    folder = tiny_root / f"ct_{preset.lower()}"
    ct_checkpoint(src, folder, preset)
    dense = ct_dense(folder)
    llm, tokens = run(str(folder))
    assert llm.engine.parts.selections["quantization"].winner.name == "compressed-tensors"
    ours = our_dense(llm)
    assert len(ours) == 2 * len(LINEARS)
    for name, w in ours.items():
        assert torch.equal(w, dense[name]), name
        assert not torch.equal(w, torch.zeros_like(w))
    assert tokens == reference_tokens(src, dense)


def test_quant_method_fp8_static(src: str, tiny_root: Path) -> None:
    """AutoFP8 / vLLM layout: scalar weight_scale and input_scale per layer, `activation_scheme: static`."""
    from safetensors.torch import load_file, save_file

    ct_folder = tiny_root / "ct_fp8"
    ct_checkpoint(src, ct_folder, "FP8")
    folder = tiny_root / "fp8_static"
    folder.mkdir(exist_ok=True)
    state = {k: (v.reshape(()) if k.endswith("_scale") else v)
             for k, v in load_file(str(ct_folder / "model.safetensors")).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ct_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": []}
    (folder / "config.json").write_text(json.dumps(config))
    llm, tokens = run(str(folder))
    assert llm.engine.parts.selections["quantization"].winner.name == "fp8"
    qkv = llm.engine.parts.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and float(qkv.fp8_input_scale) == pytest.approx(0.02)
    assert tokens == reference_tokens(src, ct_dense(ct_folder))


def test_on_the_fly_fp8(src: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    llm, tokens = run(src, quantization="fp8")
    assert llm.engine.parts.selections["quantization"].winner.name == "fp8"
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    ours = our_dense(llm)
    reference = {k: v.float() for k, v in load_file(str(Path(src) / "model.safetensors")).items()}
    max_steps = 0.0
    for name, w in ours.items():
        dense = reference[name]
        scale, zero = calculate_qparams(dense.amin(1, keepdim=True), dense.amax(1, keepdim=True), args)
        theirs = dequantize(quantize(dense, scale, zero, args), scale, args=args, dtype=torch.float32)
        # e4m3 has 3 mantissa bits: one step is 1/8 of the value's power of two (2^-9 * scale at the bottom).
        step = torch.maximum(theirs.abs() / 8, scale * 2.0**-9)
        max_steps = max(max_steps, float(((w - theirs).abs() / step).max()))
        reference[name] = w  # the dequantized-float model is the one we run
    assert max_steps <= 1.0, f"fp8 codes differ from compressed-tensors by {max_steps:.2f} steps"
    assert tokens == reference_tokens(src, reference)
    layer = llm.engine.parts.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.element_size() == 1


def test_unsupported_configs_are_refused(src: str) -> None:
    assert fp8_reasons(None) == []
    assert "weight_block_size" in fp8_reasons({"quant_method": "fp8", "weight_block_size": [128, 128]})[0]
    assert "awq" in fp8_reasons({"quant_method": "awq"})[0]
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}}}}
    reasons = " ".join(compressed_tensors_reasons(int4))
    assert "format is 'pack-quantized'" in reasons and "4-bit int" in reasons and "strategy is 'group'" in reasons
    with pytest.raises(SelectionError, match="awq.*cannot be used.*no quantization_config"):
        LLM(src, quantization="awq")
