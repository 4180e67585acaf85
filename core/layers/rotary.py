"""Rotary position embedding (RoPE) with a precomputed cos/sin cache indexed by position.

Neox style (Llama, Qwen, Mistral, Gemma) rotates the two halves of each head: for x = [x1 | x2]
(rotary_dim / 2 each),
    out = [x1 * cos - x2 * sin | x2 * cos + x1 * sin]
GPT-J style (`is_neox_style=False`) rotates interleaved pairs (x[2i], x[2i + 1]) by the same angles.
angle(pos, i) = pos * inv_freq[i]. Dimensions past rotary_dim (partial rotary) pass through unchanged.
YaRN (`rope_type: yarn`, gpt-oss) blends interpolated and original frequencies and also scales cos and sin by
its attention factor (transformers' `attention_scaling`), folded into the cache here.
On CUDA one Triton kernel rotates q and k in place (core/layers/triton_ops.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.layers.fused_ops import FusedOp, cpu_ops_of, use_fused


class RotaryEmbedding(FusedOp, nn.Module):
    """Applies RoPE to q and k at given positions. `rope_scaling` is a HF rope dict (rope_type + its fields).

    The cache holds max_position rows; build one per model and share it between layers.
    """

    cos_cache: torch.Tensor  # [max_position, rotary_dim / 2] float32
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq = _inv_freq(rotary_dim, base, rope_scaling)
        # Computed in float32 like transformers does, then cast to the activation dtype when applied.
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        # transformers multiplies cos and sin by the scaling type's attention factor (1 except for YaRN) in
        # float32 before the cast; doing it once here gives the same products on every path reading the cache.
        factor = _attention_factor(rope_scaling)
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        # persistent=False: the cache is derived from the config, never read from a checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, nh * hs] and key [T, nkv * hs] (or [T, heads, hs]); returns them rotated.

        Use the returned tensors: the torch path returns rotated copies, the fused paths (Triton, and the
        CPU's C kernel) rotate query and key in place (they are views into the step's qkv output) and return
        them.
        Positions must be < max_position (no bounds check here: it would cost a device sync per layer).
        """
        ops = cpu_ops_of(self)  # fused_ops.py NOTE 3; bit-identical to the torch code (cpu_ops.c NOTE 1)
        if (
            ops is not None
            and self.is_neox_style
            and positions.dtype == torch.int64
            and query.dtype == torch.float32
            and query.dim() == 2
            and key.dim() == 2
            and query.stride(-1) == 1
            and key.stride(-1) == 1
        ):
            ops.rotary_neox(positions, query, key, self.cos_cache, self.sin_cache, self.head_size)
            return query, key
        if use_fused(self, query) and query.stride(-1) == 1 and key.stride(-1) == 1:
            from pagedllm.layers.triton_ops import rotary_embedding

            return rotary_embedding(
                positions, query, key, self.cos_cache, self.sin_cache, self.head_size, self.is_neox_style
            )
        if self.rotary_dim == self.head_size and self.is_neox_style:
            cos2, sin2 = self._full_width(positions)
            return self._rotate_full(query, cos2, sin2), self._rotate_full(key, cos2, sin2)
        cos = self.cos_cache[positions].unsqueeze(-2)  # [T, 1, rotary_dim / 2], broadcast over heads
        sin = self.sin_cache[positions].unsqueeze(-2)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _full_width(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos | cos] and [-sin | sin] at `positions`, [T, 1, head_size], computed once per step.

        NOTE: on the CPU every step builds a fresh positions tensor and every layer passes that same object to
        this shared module, so the lookup is kept for the next call with the same object: one lookup per step
        instead of one per layer (~6 CPU ops each). The memo holds a reference, so the id cannot be reused.
        (Inference tensors have no version counter to check; nothing writes positions during a step.) Not on
        CUDA, where a captured graph must contain the lookup and buffers are reused across steps.
        """
        memo = self.__dict__.get("_memo")
        if memo is not None and memo[0] is positions:
            return memo[1], memo[2]
        cos = self.cos_cache[positions]
        sin = self.sin_cache[positions]
        cos2 = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
        sin2 = torch.cat((-sin, sin), dim=-1).unsqueeze(-2)
        if positions.device.type == "cpu":
            self.__dict__["_memo"] = (positions, cos2, sin2)
        return cos2, sin2

    def _rotate_full(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """Neox rotation of whole heads: x * [cos|cos] + [x2|x1] * [-sin|sin], bit-identical to `_rotate`
        (x1 * cos - x2 * sin == x1 * cos + x2 * (-sin) in IEEE arithmetic) in 4 ops instead of 9."""
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_size)
        half = self.head_size // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return (x * cos2.to(x.dtype) + swapped * sin2.to(x.dtype)).view(shape)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_size)  # q/k may be non-contiguous slices of the qkv output
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1).view(shape)


def _inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """inv_freq[i] = base^(-2i / rotary_dim), adjusted by the scaling type."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_scaling is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Scaling positions by 1/factor equals scaling the frequencies by 1/factor.
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, base, rope_scaling)
    raise ValueError(f"rope type '{rope_type}' is not supported (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than `beta_fast` times are
    kept, and a linear ramp blends the ones between. `truncate` (default true) rounds the ramp's ends outwards.
    """
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension index whose wavelength fits `rotations` times into the original context.
        return (rotary_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: the interpolated one
    # 1 / (factor * base^(2i/d)) spelled as transformers does, so the products round the same way.
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + inv_freq * keep


def _attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's 0.1 * ln(factor) + 1 (or its `attention_factor`, or the
    mscale / mscale_all_dim ratio), 1.0 for every other scaling type."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a HF config, old (rope_theta + rope_scaling) or new
    (rope_parameters, transformers >= 5) style."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else dict(params))
    theta = float(getattr(hf_config, "rope_theta", None) or 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None)
    return theta, (dict(scaling) if scaling else None)


def get_rope(hf_config: Any, head_size: int, is_neox_style: bool = True) -> RotaryEmbedding:
    """The RotaryEmbedding a HF config describes (theta, scaling, partial_rotary_factor)."""
    theta, scaling = rope_settings(hf_config)
    factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is None and isinstance(getattr(hf_config, "rope_parameters", None), dict):
        factor = hf_config.rope_parameters.get("partial_rotary_factor")
    rotary_dim = int(head_size * (factor or 1.0))
    max_position = int(getattr(hf_config, "max_position_embeddings", 4096) or 4096)
    return RotaryEmbedding(head_size, rotary_dim, max_position, theta, scaling, is_neox_style)
