"""Reading a GGUF file's header and tensor table, with the tensor bytes left memory-mapped.

Layout (ggml's docs/gguf.md; gguf-py's ``gguf_reader.py`` reads the same)::

    magic "GGUF" | u32 version (2, 3) | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value_type, value)         string = u64 length + utf-8 bytes
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] fastest-first, u32 ggml_type, u64 offset)
    padding to general.alignment (default 32) | tensor data, each tensor at data_start + offset

NOTE 1: gguf-py's GGUFReader builds a numpy memmap view for every element it parses; a 49k-token vocabulary
and its merges took it 3.7 s on an idle core (11-16 s on our shared two), longer than dequantizing the whole
model. This reader walks the same header with ``struct`` in a fraction of that and hands gguf-py's
``quants.dequantize`` byte arrays exactly shaped as GGUFReader would.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# value type id -> struct format of the fixed-size metadata types; 8 is string, 9 is array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# The same types as numpy dtypes, for reading numeric arrays in one call.
_NUMPY = {k: np.dtype("?" if k == 7 else fmt) for k, fmt in _SCALARS.items()}
# ggml types stored as plain numbers; every other type is blocks (quants.dequantize wants uint8 rows).
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFError(ValueError):
    """A GGUF file this loader cannot use; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table. `shape` is in torch/HF order (the file lists dims reversed)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF header: `metadata` (key -> Python value), `tensors` (file order), mapped tensor data."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file '{path}' does not exist")
        self.path = path
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise GGUFError(f"'{path}' is not a GGUF file: bad magic {magic!r} (expected {GGUF_MAGIC!r})")
            # The map outlives the file handle; numpy views of it keep it alive while tensors are read.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 4
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
            raise GGUFError(
                f"'{path}' is truncated or corrupt ({self.size} bytes): its header cannot be read "
                f"at byte {self._pos} ({type(exc).__name__}: {exc})"
            ) from exc
        for t in self.tensors:
            if t.offset + t.nbytes > self.size:
                raise GGUFError(
                    f"'{path}' is truncated: tensor {t.name} ends at byte {t.offset + t.nbytes}, "
                    f"the file has {self.size} bytes"
                )

    def data(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only array shaped as gguf-py's quants.dequantize expects (no copy)."""
        plain = _PLAIN_TYPES.get(tensor.ggml_type)
        dtype = np.dtype(plain if plain is not None else np.uint8)
        shape = (
            tensor.shape if plain is not None else quant_shape_to_byte_shape(tensor.shape, tensor.ggml_type)
        )
        flat = np.frombuffer(
            self._map, dtype=dtype, count=tensor.nbytes // dtype.itemsize, offset=tensor.offset
        )
        return flat.reshape(shape)

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version not in _VERSIONS:
            # A big-endian file reads as a version with its low 16 bits zero.
            raise GGUFError(f"'{self.path}': GGUF version {version} is not supported (only {_VERSIONS})")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            metadata[key] = self._value(value_type)
        entries = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            raw_type, offset = self._unpack("<IQ")
            entries.append((name, tuple(reversed(dims)), raw_type, offset))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"'{self.path}': general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        tensors = []
        for name, shape, raw_type, offset in entries:
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"'{self.path}': tensor {name} has unknown ggml type {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_elements = int(np.prod(shape, dtype=np.int64))
            tensors.append(
                GGUFTensor(name, ggml_type, shape, data_start + offset, n_elements // block * type_size)
            )
        return metadata, tensors

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start, self._pos = self._pos, self._pos + length
        if self._pos > self.size:
            raise struct.error(f"a string of {length} bytes runs past the end of the file")
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])[0]
        if value_type == 8:
            return self._string()
        if value_type != 9:
            raise GGUFError(f"'{self.path}': metadata value type {value_type} at byte {self._pos} is unknown")
        item_type, count = self._unpack("<IQ")
        if item_type in _NUMPY:  # token types, scores: one numpy read instead of a struct call per item
            dtype = _NUMPY[item_type]
            if self._pos + count * dtype.itemsize > self.size:
                raise struct.error(f"an array of {count} items runs past the end of the file")
            items = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).tolist()
            self._pos += count * dtype.itemsize
            return items
        return [self._value(item_type) for _ in range(count)]
