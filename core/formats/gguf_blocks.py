"""GGUF quantized blocks as torch tensors: the container the loader hands to layers, and dequantization.

ggml's block layouts (``ggml-common.h``; gguf-py's ``quants.py`` dequantizes the same), 32 weights per
block, blocks running along a row (the input axis), little-endian::

    Q4_0  18 B: f16 d | 16 B nibbles                   w = d * (q - 8)
    Q4_1  20 B: f16 d | f16 m | 16 B nibbles           w = d * q + m
    Q5_0  22 B: f16 d | u32 high bits | 16 B nibbles   w = d * (q - 16),   q = nibble | high_bit << 4
    Q5_1  24 B: f16 d | f16 m | u32 high bits | 16 B   w = d * q + m
    Q8_0  34 B: f16 d | 32 x i8                        w = d * q

Nibble byte j holds element j (low 4 bits) and element j + 16 (high 4 bits); high bit i of Q5 is element
i's. Every other type (K-quants, IQ*) is dequantized by gguf-py itself (numpy), which is exact but slow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

Q = GGMLQuantizationType
# Types we decode in torch into (q, scale, zero) per 32-weight group: w = scale * q + zero.
TORCH_DECODED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
DENSE_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@dataclass
class GGUFBlocks:
    """One GGUF tensor kept in its file layout: `data` is uint8 [rows, bytes per row] (rows = output axis).

    `shape` is the logical [rows, cols] of the matrix it encodes. Rows are independent (blocks never cross a
    row), so narrowing `data` along dim 0 selects output rows exactly as it would on the dense matrix.
    """

    data: torch.Tensor
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]

    def narrow_rows(self, start: int, length: int) -> GGUFBlocks:
        """Rows start .. start+length (a tensor-parallel or fused-piece slice), still quantized."""
        return GGUFBlocks(self.data.narrow(0, start, length), self.ggml_type, (length, self.shape[1]))

    def narrow_cols(self, start: int, length: int) -> GGUFBlocks:
        """Columns start .. start+length of every row (a row-parallel slice), still quantized.

        Blocks run along a row, so the slice must begin and end on block boundaries (32 weights for the
        Q4/Q5/Q8 types, 256 for K-quants); a ValueError says which boundary is missed.
        """
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        if start % block or length % block:
            raise ValueError(
                f"{self.ggml_type.name} holds {block} weights per block; columns {start}..{start + length} of "
                f"{self.shape[1]} do not fall on block boundaries, so this tensor cannot be split across "
                f"tensor-parallel ranks kept quantized (use quantization: none)"
            )
        data = self.data.narrow(1, start // block * type_size, length // block * type_size)
        return GGUFBlocks(data, self.ggml_type, (self.shape[0], length))

    def pad_rows(self, rows: int) -> GGUFBlocks:
        """Append all-zero rows up to `rows`: zero bytes decode to zero weights (every block's scale is 0)."""
        if rows <= self.shape[0]:
            return self
        pad = torch.zeros(rows - self.shape[0], self.data.shape[1], dtype=self.data.dtype)
        return GGUFBlocks(torch.cat([self.data, pad]), self.ggml_type, (rows, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these blocks encode."""
        return dequantize_blocks(self.data, self.ggml_type, self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


# Byte offsets of the f16 fields (scales d, minimums m / dmin) inside one block, per type (ggml-common.h);
# every other byte of these types is a code or a packed sub-scale, for which any bit pattern is valid.
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
# Scales drawn from [2^-14, 2^-10]: normal f16 values, small enough that random codes keep a 32-layer model's
# activations finite (Q4_0: |w| <= 8 x 2^-10; the K-quants' sub-scales multiply it, Q6_K up to ~4).
_DUMMY_SCALE = (2.0**-14, 2.0**-10)


def random_blocks(
    ggml_type: GGMLQuantizationType, rows: int, cols: int, generator: torch.Generator, device: torch.device
) -> GGUFBlocks:
    """Valid random blocks of `ggml_type` for a [rows, cols] matrix, drawn on `device` (dummy weights): random
    code bytes, every f16 field a small positive scale (random bytes there could be inf or NaN)."""
    if ggml_type not in F16_FIELDS:
        raise ValueError(f"no random blocks for {ggml_type.name} (supported: {', '.join(t.name for t in F16_FIELDS)})")
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if cols % block:
        raise ValueError(f"{ggml_type.name} holds {block} weights per block; {cols} columns are not a multiple")
    data = torch.empty(rows, cols // block, type_size, dtype=torch.uint8, device=device)
    data.random_(0, 256, generator=generator)
    for offset in F16_FIELDS[ggml_type]:
        scale = torch.empty(rows, cols // block, 1, dtype=torch.float16, device=device)
        scale.uniform_(*_DUMMY_SCALE, generator=generator)
        data[..., offset : offset + 2] = scale.view(torch.uint8)
    return GGUFBlocks(data.reshape(rows, -1), ggml_type, (rows, cols))


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """A little-endian f16 field at byte `start` of every block, as float32 [..., 1]."""
    return raw[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per block -> 32 values 0..15 in element order (low nibbles first)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def decode_blocks(
    data: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [rows, cols] int32, scale [rows, cols/32] float32, zero or None) with w = scale * q + zero.

    For the symmetric types q is already centred (Q4_0: q - 8, Q5_0: q - 16, Q8_0: signed) and zero is None.
    """
    if ggml_type not in TORCH_DECODED:
        raise ValueError(f"{ggml_type.name} is not decoded in torch")
    rows, cols = shape
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = data.reshape(rows, cols // block, type_size)
    d = _f16(raw, 0)
    zero = None
    if ggml_type == Q.Q8_0:
        q = raw[..., 2:].contiguous().view(torch.int8).int()
    elif ggml_type in (Q.Q4_0, Q.Q4_1):
        offset = 2 if ggml_type == Q.Q4_0 else 4
        q = _nibbles(raw[..., offset:]).int()
        if ggml_type == Q.Q4_0:
            q = q - 8
        else:
            zero = _f16(raw, 2)
    else:  # Q5_0 / Q5_1
        offset = 2 if ggml_type == Q.Q5_0 else 4
        qh = raw[..., offset : offset + 4].int()
        high = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        bits = (high.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        q = _nibbles(raw[..., offset + 4 :]).int() | (bits << 4)
        if ggml_type == Q.Q5_0:
            q = q - 16
        else:
            zero = _f16(raw, 2)
    scale = d.squeeze(-1)
    return q.reshape(rows, cols), scale, None if zero is None else zero.squeeze(-1)


def dequantize_blocks(
    data: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, int]
) -> torch.Tensor:
    """The float32 [rows, cols] matrix of GGUF blocks `data` (uint8 [rows, bytes per row])."""
    if ggml_type in DENSE_TYPES:
        return data.contiguous().view(DENSE_TYPES[ggml_type]).reshape(shape).float()
    if ggml_type in TORCH_DECODED:
        q, scale, zero = decode_blocks(data, ggml_type, shape)
        rows, cols = shape
        w = q.reshape(rows, -1, 32).float() * scale.unsqueeze(-1)
        if zero is not None:
            w = w + zero.unsqueeze(-1)
        return w.reshape(rows, cols)
    # K-quants and the rest: gguf-py's reference implementation (numpy, exact).
    values = gguf_dequantize(data.numpy(), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
