"""A GGUF file's llama.cpp metadata as the engine's model config, and its end-of-generation token ids.

llama.cpp keys are ``{arch}.<name>`` (gguf-py's ``gguf/constants.py``, ``Keys``); the mapping to transformers
config fields follows transformers' ``integrations/ggml.py``::

    {arch}.block_count                       -> num_hidden_layers
    {arch}.embedding_length                  -> hidden_size
    {arch}.feed_forward_length               -> intermediate_size
    {arch}.attention.head_count / _kv        -> num_attention_heads / num_key_value_heads
    {arch}.attention.key_length              -> head_dim (llama also: rope.dimension_count)
    {arch}.attention.layer_norm_rms_epsilon  -> rms_norm_eps
    {arch}.context_length                    -> max_position_embeddings
    {arch}.rope.freq_base, rope.scaling.*    -> rope_parameters
    tokenizer.ggml.{bos,eos,padding}_token_id -> bos/eos/pad_token_id
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGMLQuantizationType

from pagedllm.api.loading import model_config_from_dict
from pagedllm.plugins.loaders.gguf.file import GGUFError, GGUFFile, GGUFTensor


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps onto a transformers config and model class."""

    config_class: str
    model_type: str  # the config class's, which picks the defaults the config reader fills in
    hf_architecture: str
    # NOTE 1: llama.cpp's HF->GGUF converter interleaves the rows of q/k (weights and biases) of llama-family
    # models for its non-NeoX rotary kernel; qwen2/qwen3 use NeoX rotary and are stored unpermuted.
    permuted_qk: bool
    takes_head_dim: bool  # Qwen2Config has no head_dim: it is always hidden_size // num_attention_heads
    bias_flags: tuple[str, ...]  # config flags turned on by q / ffn bias tensors (qwen2's biases are implied)


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaConfig", "llama", "LlamaForCausalLM", True, True, ("attention_bias", "mlp_bias")),
    "qwen2": GGUFArch("Qwen2Config", "qwen2", "Qwen2ForCausalLM", False, False, ()),
    "qwen3": GGUFArch("Qwen3Config", "qwen3", "Qwen3ForCausalLM", False, True, ("attention_bias",)),
}
_BIAS_TENSORS = ("blk.0.attn_q.bias", "blk.0.ffn_up.bias")  # paired with GGUFArch.bias_flags in order


def gguf_arch(gguf: GGUFFile) -> tuple[str, GGUFArch]:
    """(llama.cpp architecture name, its mapping); GGUFError for an architecture we have no model for."""
    name = gguf.metadata.get("general.architecture")
    if name not in ARCHS:
        raise GGUFError(
            f"'{gguf.path}': GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHS))})"
        )
    return name, ARCHS[name]


def head_counts(gguf: GGUFFile, arch: str) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads); the q/k un-permutation needs both."""
    n_head = _int(gguf, f"{arch}.attention.head_count")
    if gguf.metadata.get(f"{arch}.attention.head_count_kv") is None:
        return n_head, n_head
    return n_head, _int(gguf, f"{arch}.attention.head_count_kv")


def build_hf_config(gguf: GGUFFile) -> Any:
    """The engine's config (as transformers' LlamaConfig / Qwen2Config / Qwen3Config would read it) built from
    the file's metadata alone, without importing transformers' config classes (their import is most of a
    second of start-up)."""
    arch, spec = gguf_arch(gguf)
    md = gguf.metadata
    tensors = {t.name: t for t in gguf.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"'{gguf.path}' has no token_embd.weight tensor")
    n_head, n_kv = head_counts(gguf, arch)
    hidden = _int(gguf, f"{arch}.embedding_length")
    head_dim = md.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = md.get(f"{arch}.rope.dimension_count")  # llama.cpp's converter writes head_dim here
    head_dim = int(head_dim) if head_dim is not None else hidden // n_head
    if not spec.takes_head_dim and head_dim != hidden // n_head:
        raise GGUFError(
            f"'{gguf.path}': {arch} with head_dim {head_dim} != hidden_size / heads is not supported"
        )

    kwargs: dict[str, Any] = dict(
        architectures=[spec.hf_architecture],
        # NOTE 2: the embedding's row count, not the token list, sizes the model; llama.cpp's converter pads
        # the token list to it, so the two agree in well-formed files.
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=_int(gguf, f"{arch}.feed_forward_length"),
        num_hidden_layers=_int(gguf, f"{arch}.block_count"),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        max_position_embeddings=_int(gguf, f"{arch}.context_length"),
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(gguf, arch, head_dim),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
        dtype=_float_dtype(gguf),
    )
    if spec.takes_head_dim:
        kwargs["head_dim"] = head_dim
    for flag, tensor in zip(spec.bias_flags, _BIAS_TENSORS, strict=False):
        kwargs[flag] = tensor in tensors
    return model_config_from_dict({"model_type": spec.model_type, **kwargs})


def eos_token_ids(gguf: GGUFFile) -> list[int]:
    """Ids that end generation: eos, then end-of-turn / end-of-message when the file names them."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = gguf.metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _int(gguf: GGUFFile, key: str) -> int:
    value = gguf.metadata.get(key)
    if not isinstance(value, int) or isinstance(value, bool):  # absent, or a per-layer list we do not support
        found = "missing" if value is None else f"{value!r}, not one integer"
        raise GGUFError(f"'{gguf.path}': GGUF metadata '{key}' is {found}")
    return value


def _float_dtype(gguf: GGUFFile) -> torch.dtype | None:
    """The half type of an unquantized file's matrices (F16/BF16); None for quantized or F32 files."""
    types = {t.ggml_type for t in gguf.tensors if len(t.shape) > 1}
    if types == {GGMLQuantizationType.BF16}:
        return torch.bfloat16
    if types == {GGMLQuantizationType.F16}:
        return torch.float16
    return None


def _rope_parameters(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    """transformers' rope_parameters from ``{arch}.rope.*`` (and from a llama3 ``rope_freqs`` tensor)."""
    md = gguf.metadata
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        rope.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn" and factor is not None:
        rope.update(rope_type="yarn", factor=float(factor))
        optional = {
            "original_max_position_embeddings": f"{arch}.rope.scaling.original_context_length",
            "attention_factor": f"{arch}.rope.scaling.attn_factor",
            "beta_fast": f"{arch}.rope.scaling.yarn_beta_fast",
            "beta_slow": f"{arch}.rope.scaling.yarn_beta_slow",
        }
        rope.update({name: md[key] for name, key in optional.items() if key in md})
    elif kind != "none":
        raise GGUFError(f"'{gguf.path}': rope scaling type {kind!r} is not supported")
    freqs = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        rope = _llama3_rope(gguf, freqs, theta, head_dim)
    return rope


def _llama3_rope(gguf: GGUFFile, tensor: GGUFTensor, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3.x "llama3" rope scaling, recovered from the per-frequency divisors in rope_freqs.weight.

    NOTE 3: the file keeps the divisors, not the parameters that made them. Every Llama 3.x uses
    low_freq_factor 1, high_freq_factor 4 and an 8192-token original context, with the factor equal to the
    largest divisor; we accept those only if recomputing the divisors as llama.cpp's converter does
    reproduces the file's.
    """
    if tensor.ggml_type != GGMLQuantizationType.F32:
        raise GGUFError(f"'{gguf.path}': rope_freqs.weight is {tensor.ggml_type.name}, expected F32")
    stored = torch.from_numpy(gguf.data(tensor).copy())
    factor, low, high, old_ctx = float(stored.max()), 1.0, 4.0, 8192
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    expected = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            expected.append(1.0)
        elif wavelen > old_ctx / low:
            expected.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if stored.shape != (len(expected),) or not torch.allclose(stored, torch.tensor(expected), rtol=1e-4):
        raise GGUFError(
            f"'{gguf.path}': its rope_freqs.weight does not match llama3 rope scaling (unsupported)"
        )
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_ctx,
    }
