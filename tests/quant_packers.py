"""AWQ / GPTQ packers and tiny quantized checkpoints for the quantization tests.

The packers are written from the published formats, independently of the engine's unpacking code:

- AWQ GEMM: AutoAWQ `WQLinear_GEMM.from_linear` -- intweight = round(W / s + z) per group of inputs,
  transposed to [K, N]; `qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)` with
  order_map = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros packed the same way; scales [K/G, N] float16.
- GPTQ: AutoGPTQ `QuantLinear.pack` -- intweight [K, N], `qweight[row] |= intweight[row * pf + j] << (bits * j)`;
  the v1 format stores `zeros - 1`, packed along N in order (`qzeros[:, col] |= z[:, col * pf + j] << (bits * j)`);
  `g_idx[k]` is the group of input k (with act-order the quantizer visits inputs by a permutation).

Every checkpoint is a real folder (config.json with the quantization_config the quantizer writes, model.safetensors)
of a tiny random Llama whose linear weights are replaced by their quantized form; `dense_reference` gives the
float32 weights the checkpoint decodes to (computed here from the integer codes, not by the engine).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _words(acc: np.ndarray) -> torch.Tensor:
    """uint64 accumulators holding 32-bit patterns -> int32 tensor with the same bits."""
    return torch.from_numpy(acc.astype(np.uint32).view(np.int32).copy())


def awq_pack(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's loops: intweight [K, N] and zeros [G, N] (0..15) -> qweight [K, N/8], qzeros [G, N/8]."""

    def pack(values: torch.Tensor) -> torch.Tensor:
        v = values.numpy().astype(np.uint64)
        out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
        for col in range(v.shape[1] // 8):
            for i in range(8):
                out[:, col] |= v[:, col * 8 + AWQ_ORDER_MAP[i]] << np.uint64(i * 4)
        return _words(out)

    return pack(intweight), pack(zeros)


def gptq_pack(
    intweight: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's loops: intweight [K, N], zeros [G, N] -> qweight [K/pf, N], qzeros [G, N/pf] (v1: z - 1)."""
    pf = 32 // bits
    w = intweight.numpy().astype(np.uint64)
    qweight = np.zeros((w.shape[0] // pf, w.shape[1]), dtype=np.uint64)
    for row in range(qweight.shape[0]):
        for j in range(pf):
            qweight[row] |= w[row * pf + j] << np.uint64(bits * j)
    z = zeros.numpy().astype(np.int64) - (1 if v1 else 0)
    assert (z >= 0).all(), "the v1 format cannot store a zero point of 0"
    z = z.astype(np.uint64)
    qzeros = np.zeros((z.shape[0], z.shape[1] // pf), dtype=np.uint64)
    for col in range(qzeros.shape[1]):
        for j in range(pf):
            qzeros[:, col] |= z[:, col * pf + j] << np.uint64(bits * j)
    return _words(qweight), _words(qzeros)


@dataclass
class QuantizedLinear:
    """One layer's integer codes (q [K, N], z [G, N], s [G, N], g_idx [K]) and its decoded float weight."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor

    def dense(self) -> torch.Tensor:
        """W [N, K] = ((q - z[g]) * s[g])^T in float32."""
        g = self.g_idx.long()
        return ((self.q - self.z[g]).float() * self.s[g].float()).t().contiguous()


def quantize_rtn(
    w: torch.Tensor, bits: int, group_size: int, *, sym: bool, act_order: bool, seed: int = 0, min_zero: int = 0
) -> QuantizedLinear:
    """Round-to-nearest quantization of W [N, K] in groups of inputs (what GPTQ/AWQ store, minus calibration).

    With `act_order`, inputs are grouped in a random permutation's order (as GPTQ's desc_act visits them by
    activation size), so g_idx is not monotone. `min_zero` keeps zero points >= 1 for the GPTQ v1 format.
    """
    n, k = w.shape
    maxq = (1 << bits) - 1
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // group_size).to(torch.int32)
    groups = k // group_size
    s = torch.empty(groups, n)
    z = torch.empty(groups, n, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(1).clamp(min=1e-5) * 2 / maxq
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int32)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-5)
            zero = torch.round(-lo / scale).to(torch.int32).clamp(min_zero, maxq)
        s[g] = scale.half().float()  # checkpoints store float16 scales
        z[g] = zero
    sg, zg = s[g_idx.long()].t(), z[g_idx.long()].t()  # [N, K]
    q = torch.round(w / sg + zg).clamp(0, maxq).to(torch.int32).t().contiguous()  # [K, N]
    return QuantizedLinear(q, z, s.half(), g_idx)


def write_quantized_llama(
    src_dir: str, out_dir: Path, method: str, bits: int, group_size: int, *, sym: bool = False,
    act_order: bool = False, v1: bool = True,
) -> dict[str, torch.Tensor]:
    """Write `src_dir` (a tiny float llama) quantized as `method` ("awq" / "gptq") into out_dir.

    Returns the dense float32 state dict the checkpoint decodes to (the dequantized-float model's weights).
    """
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(src_dir, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        layer = name.rsplit(".", 2)
        if len(layer) == 3 and layer[1] in LINEARS and layer[2] == "weight":
            base = name[: -len(".weight")]
            # Projections reading the same input share GPTQ's act-order permutation (it sorts that input's
            # Hessian diagonal), as real checkpoints of fused q/k/v and gate/up do.
            shared_input = base.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            seed = zlib.crc32(shared_input.encode()) % 1000
            ql = quantize_rtn(
                tensor.float(), bits, group_size, sym=sym, act_order=act_order, seed=seed,
                min_zero=1 if (method == "gptq" and v1) else 0,
            )
            if method == "awq":
                qweight, qzeros = awq_pack(ql.q, ql.z)
            else:
                qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=v1)
                out[f"{base}.g_idx"] = ql.g_idx
            out[f"{base}.qweight"], out[f"{base}.qzeros"], out[f"{base}.scales"] = qweight, qzeros, ql.s
            dense[name] = ql.dense()
        else:
            out[name] = tensor
            dense[name] = tensor.float()
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(Path(src_dir, "config.json").read_text())
    config["quantization_config"] = quantization_config(method, bits, group_size, sym, act_order, v1)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dense


def quantization_config(method: str, bits: int, group_size: int, sym: bool, act_order: bool, v1: bool) -> dict[str, Any]:
    """The quantization_config block AutoAWQ / AutoGPTQ write into config.json."""
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
            "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
            "checkpoint_format": "gptq" if v1 else "gptq_v2"}


def dense_model(src_dir: str, dense: dict[str, torch.Tensor]) -> Any:
    """The transformers model of `src_dir` with the decoded float32 weights: the reference for greedy tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model
