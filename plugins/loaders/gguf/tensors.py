"""GGUF tensors -> Hugging Face-named float32 tensors: rename, dequantize, reshape, undo the q/k permutation.

Names follow llama.cpp's ``gguf/tensor_mapping.py`` read backwards::

    token_embd.weight            -> model.embed_tokens.weight
    blk.N.attn_q / attn_k / attn_v / attn_output   -> model.layers.N.self_attn.{q,k,v,o}_proj
    blk.N.attn_q_norm / attn_k_norm                -> model.layers.N.self_attn.{q,k}_norm   (qwen3)
    blk.N.ffn_gate / ffn_up / ffn_down             -> model.layers.N.mlp.{gate,up,down}_proj
    blk.N.attn_norm / ffn_norm   -> model.layers.N.input_layernorm / post_attention_layernorm
    output_norm.weight           -> model.norm.weight
    output.weight                -> lm_head.weight

A GGUF lists dimensions fastest-moving first ([in, out] for a matrix); read in reverse they are C order
([out, in]), which is Hugging Face's layout, so a reshape is all it takes -- no transpose.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from pagedllm.api.loading import GGUFBlocks
from pagedllm.plugins.loaders.gguf.config import gguf_arch, head_counts
from pagedllm.plugins.loaders.gguf.file import GGUFError, GGUFFile, GGUFTensor

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors that carry no parameter: llama3 rope divisors, already turned into rope_parameters by the config.
_NOT_PARAMETERS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for a name outside our mapping."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        part = _BLOCK_NAMES.get(m[2])
        return None if part is None else f"model.layers.{m[1]}.{part}.{m[3]}"
    if m := _GLOBAL_RE.fullmatch(gguf_name):
        part = _GLOBAL_NAMES.get(m[1])
        return None if part is None else f"{part}.{m[2]}"
    return None


def dequantize_tensor(gguf: GGUFFile, tensor: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in Hugging Face shape (any type gguf-py can dequantize)."""
    try:
        values = dequantize(gguf.data(tensor), tensor.ggml_type)
    except (NotImplementedError, ValueError) as exc:
        raise GGUFError(
            f"'{gguf.path}': cannot dequantize {tensor.name} ({tensor.ggml_type.name}): {exc}"
        ) from exc
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map; torch wants its own copy
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False).reshape(tensor.shape))


def raw_blocks(gguf: GGUFFile, tensor: GGUFTensor) -> GGUFBlocks:
    """One matrix as its file bytes, uint8 [rows, bytes per row] (copied out of the read-only map)."""
    data = np.ascontiguousarray(gguf.data(tensor)).view(np.uint8).reshape(tensor.shape[0], -1)
    return GGUFBlocks(torch.from_numpy(data.copy()), tensor.ggml_type, (tensor.shape[0], tensor.shape[1]))


def unpermute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave (see gguf_config NOTE 1) for one weight or bias.

    The converter viewed each head's rows as [2, head_dim/2] (rotate-half order) and stored them as
    [head_dim/2, 2] (pairs adjacent); we view them as [head_dim/2, 2] and swap back.
    """
    half = weight.shape[0] // n_head // 2
    return (
        weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()
    )


def iter_gguf_weights(gguf: GGUFFile, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor) for every parameter tensor of an open GGUF, one tensor in memory at a time.

    With `keep_quantized`, every matrix comes as `GGUFBlocks` (its file bytes and type) instead, for layers
    using the `gguf` quantization method; vectors (norms, biases) are float32 either way.

    The architecture and every tensor name are checked before the first tensor is dequantized, so a file we
    cannot load fails at once rather than half-way through filling a model.
    """
    arch, spec = gguf_arch(gguf)
    n_head, n_kv = head_counts(gguf, arch)
    named: list[tuple[str, GGUFTensor]] = []
    for tensor in gguf.tensors:
        if tensor.name in _NOT_PARAMETERS:
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise GGUFError(
                f"'{gguf.path}': tensor {tensor.name!r} has no Hugging Face counterpart in {arch} models"
            )
        named.append((name, tensor))
    rotary_heads = {".self_attn.q_proj.": n_head, ".self_attn.k_proj.": n_kv} if spec.permuted_qk else {}
    return _converted(gguf, named, rotary_heads, keep_quantized)


def _converted(
    gguf: GGUFFile, named: list[tuple[str, GGUFTensor]], rotary_heads: dict[str, int], keep_quantized: bool
) -> Iterator[tuple[str, Any]]:
    for name, tensor in named:
        if keep_quantized and len(tensor.shape) == 2:
            blocks = raw_blocks(gguf, tensor)
            for part, heads in rotary_heads.items():
                if part in name:  # rows are independent, so the byte rows permute like the dense rows
                    blocks.data = unpermute_rotary(blocks.data, heads)
            yield name, blocks
            continue
        value = dequantize_tensor(gguf, tensor)
        for part, heads in rotary_heads.items():
            if part in name:
                value = unpermute_rotary(value, heads)
        yield name, value


def iter_hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Open the GGUF at `path` and yield its weights as (Hugging Face name, float32 tensor) pairs.

    Opening and validation happen on the call (FileNotFoundError / GGUFError name the path); the tensors are
    dequantized lazily as the iterator is consumed.
    """
    return iter_gguf_weights(GGUFFile(path))
