"""Matmul kernels for GGUF weights kept quantized, each an nn.Module whose buffers are the resident weight.

Every kernel computes y = x @ W^T for one [N, K] matrix W and can return dequantized rows W[ids] (so a tied
embedding and LM head share one quantized copy):

    NativeKernel      Q4_0, Q4_1, Q8_0 on the CPU: the file's blocks as they are, read by our C kernels
                      (gguf_cpu.c, built at first use) with float32 activations: the default on the CPU
                      (large products through a bf16 copy where the CPU has bf16 units: NOTE 4; through an
                      int8 copy with `cpu_kernels: int8`: NOTE 5)
    Int4PackKernel    4-bit, 32-groups: PyTorch's CPU int4 weight-only GEMM (Q4_0, Q4_1, requantized rows)
    GroupInt8Kernel   8-bit q with a scale (and zero) per 32-group: one int8 weight-only GEMM per group
                      column (Q8_0, Q5_0, Q5_1)
    TritonKernel      CUDA, Q4_0 .. Q8_0 and Q2_K .. Q6_K: the file's blocks read by gguf/triton_gemm.py's kernels
                      (a GEMV for <= 8 rows, else dequantize to a scratch matrix + cuBLAS): `quantization: gguf`
                      on CUDA
    DequantKernel     any type: blocks kept, dequantized per call (optionally cached once as float)
    DenseKernel       F32 / F16 / BF16 tensors of a GGUF file

NOTE 1: aten's CPU int4 GEMM (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``) dequantizes a weight as
``(q - 8) * scale + zero`` per group, scale and zero interleaved in a [K/group, N, 2] tensor of the activation
dtype. Its AVX2/AVX512 paths are vectorized for bfloat16 only (float32 and float16 fall to a scalar loop,
~15x slower here), so activations, scales and zeros go in as bfloat16 and the output comes back in x's dtype.
Q4_1 (w = d * q + m) maps to scale d, zero m + 8d; Q4_0 (w = d * (q - 8)) to scale d, zero 0.
NOTE 2: aten's int8 weight-only GEMM takes one scale per output row, but Q8_0 has one per 32 inputs, so we
run it once per group column with that column's scales and sum in float32: the weights stay exact, only the
activations and the per-group partial sums are rounded to bfloat16.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.plugins.quantization.gguf.batch_gemm import Bf16Matrix
from pagedllm.plugins.quantization.gguf.int8_gemm import Int8Library, Int8Matrix

GROUP = 32
_ACT = torch.bfloat16  # NOTE 1
# NOTE 3: from this many activation rows on (prefill chunks, large batches) NativeKernel dequantizes the whole
# matrix in C and lets MKL's float32 GEMM do the rest; below it its own kernel decodes each block once per 4
# rows. An estimate, not yet tuned: the crossover could not be measured on the shared machine (perf-notes §6).
NATIVE_GEMM_ROWS = 16
# NOTE 6: a kept bf16 or int8 copy (NOTE 4, 5) takes products from fewer rows than the float32 path: it has no
# per-call dequantization to amortize, only the GEMM's fixed cost against gguf_cpu.c's decode kernel, whose
# time grows fastest with the rows (SmolLM2's 49,152-row LM head at 12 rows: 10.9 ms against the bf16 GEMM's
# 3.5). Measured per matrix with tools/bench_cpu_gemm.py (2 threads, weights from memory, Zen 4): the bf16
# GEMM wins a layer's products from 8 rows (0.75 vs 0.85 ms); the int8 GEMM already from 4, and end to end
# (tools/bench_cpu_copy_rows.py --cpu-kernels int8) decode batches of 2 and 3 ran 1.07-1.08x faster from 2
# rows than from 4, a single stream tied (0.99x) at more CPU time, so it stays on the C kernel.
COPY_GEMM_ROWS = 8
INT8_COPY_ROWS = 2
# NOTE 4: on a CPU with bf16 dot products (AMX / AVX512-BF16) the >= COPY_GEMM_ROWS products run a bf16 GEMM
# on a bf16 copy of the matrix made once at load (`keep_bf16_copy`, in bf16_gemm.c's panels where it builds,
# else packed for oneDNN: batch_gemm.py; the engine's `cpu_kernels`, chosen in pagedllm's
# platform/cpu_compute.py) instead of dequantizing to float32 per call: torch's bf16 GEMM ran ~2-3.5x its
# float32 GEMM at 32-256 rows on an AVX512-BF16 EPYC (bf16_gemm.c 1.35-2x oneDNN's at 16-64), and the per-call
# dequantization (424 MB of float32 writes per SmolLM2 step) is gone. Fewer rows (decode) keep the C kernel: a
# bf16 GEMV at SmolLM2's widths costs ~40 us a call in fixed overhead, more than the C kernel's whole product.
# NOTE 5: with `cpu_kernels: int8` (AVX512-VNNI), the >= INT8_COPY_ROWS products run int8_gemm.c instead, on an int8
# copy of the matrix made once at load (`keep_int8_copy`: the 4-bit values unpacked to bytes, their per-32
# scales kept) with the activations rounded to int8 per 32 as llama.cpp does; 1.6-2.6x the bf16 GEMM at
# SmolLM2's shapes (platform/cpu_compute.py NOTE 4). A kernel keeps one of the two copies, never both.


class NativeKernel(nn.Module):
    """The GGUF blocks as stored in the file, multiplied by gguf_cpu.c (float32 activations, exact weights)."""

    blocks: torch.Tensor

    def __init__(self, data: torch.Tensor, ggml_type: int, shape: tuple[int, int], lib: Any) -> None:
        super().__init__()
        self.register_buffer("blocks", data.contiguous())
        self.ggml_type = int(ggml_type)
        self.n, self.k = shape
        self._lib = lib
        self._bf16: Bf16Matrix | None = None  # NOTE 4: the matrix in bf16 for large products, when kept
        self._int8: Int8Matrix | None = None  # NOTE 5: or in int8
        self.direct_rows = NATIVE_GEMM_ROWS  # products of fewer rows run gguf_cpu.c's kernel (NOTE 3, 6)

    def keep_bf16_copy(self, out_dtype: torch.dtype = torch.float32) -> None:
        """Keep the matrix dequantized to bf16 for products of >= COPY_GEMM_ROWS rows (NOTE 4, 6), whose outputs
        then come back in `out_dtype` (the model's activations) whatever x's dtype."""
        self._int8 = None
        self._bf16 = Bf16Matrix(self.dequantize(), out_dtype)
        self.direct_rows = COPY_GEMM_ROWS

    def keep_int8_copy(self, lib: Int8Library, out_dtype: torch.dtype = torch.float32) -> None:
        """Keep the matrix repacked for int8_gemm.c for products of >= INT8_COPY_ROWS rows (NOTE 5, 6), their
        outputs in `out_dtype`."""
        self._bf16 = None
        self._int8 = Int8Matrix(lib, self.ggml_type, self.blocks, self.n, self.k, out_dtype)
        self.direct_rows = INT8_COPY_ROWS

    @property
    def has_bf16_copy(self) -> bool:
        return self._bf16 is not None

    @property
    def has_int8_copy(self) -> bool:
        return self._int8 is not None

    def uses_batch_copy(self, x: torch.Tensor) -> bool:
        """Whether forward(x) runs the bf16 or int8 GEMM (NOTE 4, 5), whose products are rounded."""
        return (self._bf16 is not None or self._int8 is not None) and x.numel() // self.k >= self.direct_rows

    def uses_bf16(self, x: torch.Tensor) -> bool:
        """Whether forward(x) runs the bf16 GEMM (NOTE 4)."""
        return self._bf16 is not None and x.numel() // self.k >= self.direct_rows

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W^T [..., N] as the bf16 GEMM writes it (bf16), or None where forward(x) would not run it."""
        if self._bf16 is None or not self.uses_bf16(x):
            return None
        return self._bf16.product(x.reshape(-1, self.k)).reshape(*x.shape[:-1], self.n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] < self.direct_rows and x.dtype == torch.float32 and x.is_contiguous():
            # NOTE: the decode path (~120 calls a token): no reshapes, and the buffer read from _buffers
            # directly (nn.Module.__getattr__ costs ~1 us a call here).
            y = torch.empty(x.shape[0], self.n)
            self._lib.matmul(self.ggml_type, self._buffers["blocks"], self.n, self.k, x, y)
            return y
        flat = x.reshape(-1, self.k)
        if self._int8 is not None and flat.shape[0] >= self.direct_rows:
            return self._int8(flat).reshape(*x.shape[:-1], self.n)
        if self._bf16 is not None and flat.shape[0] >= self.direct_rows:
            return self._bf16(flat).reshape(*x.shape[:-1], self.n)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        if flat.shape[0] >= NATIVE_GEMM_ROWS:
            y = F.linear(flat, self.dequantize())
        else:
            y = torch.empty(flat.shape[0], self.n)
            self._lib.matmul(self.ggml_type, self.blocks, self.n, self.k, flat, y)
        if x.dim() != 2 or x.dtype != torch.float32:
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.n)
        return y

    def row_call(self, x: torch.Tensor, out: torch.Tensor) -> tuple[Any, ...]:
        """out [1, n] = x [1, k] @ W^T as (C function, arguments but the thread count): NativeLibrary.row_call."""
        blocks = self._buffers["blocks"]
        assert blocks is not None
        return cast(tuple[Any, ...], self._lib.row_call(self.ggml_type, blocks, self.n, self.k, x, out))

    def dequantize(self) -> torch.Tensor:
        """The whole [N, K] matrix in float32 (a temporary: nothing keeps it)."""
        out = torch.empty(self.n, self.k)
        self._lib.dequantize_rows(self.ggml_type, self.blocks, self.n, self.k, None, out)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows W[ids] (float32)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.k)
        self._lib.dequantize_rows(self.ggml_type, self.blocks, self.n, self.k, ids, out)
        return out


class Int4PackKernel(nn.Module):
    """w = (q - 8) * scale + zero, q in 0..15, one (scale, zero) per 32 inputs; aten's CPU int4 GEMM."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        super().__init__()
        n, k = q.shape
        self.n, self.k = n, k
        pad = -n % 64  # whole 64-row chunks: aten packs a partial chunk differently (and rows() assumes not)
        q32 = F.pad(q.to(torch.int32), (0, 0, 0, pad))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1))
        sz = torch.stack([F.pad(scale.float(), (0, 0, 0, pad)), F.pad(zero.float(), (0, 0, 0, pad))], dim=-1)
        self.register_buffer("scale_zeros", sz.transpose(0, 1).contiguous().to(_ACT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k).to(_ACT)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zeros)
        return y[:, : self.n].to(x.dtype).reshape(*x.shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows W[ids] (float32), read straight out of the packed layout."""
        base, stride, shift = _int4pack_layout(self.k)
        chunk, r = ids // 64, ids % 64
        flat = self.packed.reshape(-1)
        cols = torch.arange(self.k)
        index = (chunk * 64 * self.k // 2 + base[r]).unsqueeze(-1) + cols * stride
        q = (flat[index].int() >> shift[r].unsqueeze(-1)) & 0x0F
        sz = self.scale_zeros[:, ids].float()  # [K/32, T, 2]
        scale = sz[..., 0].t().repeat_interleave(GROUP, dim=1)
        zero = sz[..., 1].t().repeat_interleave(GROUP, dim=1)
        return (q.float() - 8) * scale + zero


@functools.cache
def _int4pack_layout(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where row r (of a 64-row chunk) and input 0 sit in aten's packed bytes: (byte, stride per input, shift).

    The layout depends on the CPU's vector width (ATen packs 32 rows for AVX2, 64 for AVX512, pairs without
    SIMD), so rather than copy one we ask the packer: one marked row at a time, then check a random matrix.
    """
    base, stride, shift = [], [], []
    for r in range(64):
        probe = torch.zeros(64, k, dtype=torch.int32)
        probe[r] = 1
        flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).reshape(-1)
        where = flat.nonzero().flatten()
        base.append(int(where[0]))
        stride.append(int(where[1] - where[0]) if k > 1 else 0)
        shift.append(0 if int(flat[where[0]]) == 1 else 4)
    layout = torch.tensor(base), torch.tensor(stride), torch.tensor(shift)
    if len(set(stride)) != 1:
        raise RuntimeError("unexpected int4pack layout: the byte stride differs between rows")
    check = torch.randint(0, 16, (64, k), dtype=torch.int32)
    flat = torch.ops.aten._convert_weight_to_int4pack_for_cpu(check, 1).reshape(-1)
    index = layout[0].unsqueeze(-1) + torch.arange(k) * stride[0]
    if not torch.equal((flat[index].int() >> layout[2].unsqueeze(-1)) & 0x0F, check):
        raise RuntimeError("unexpected int4pack layout: probing did not reproduce a random matrix")
    return layout[0], torch.tensor(stride[0]), layout[2]


class GroupInt8Kernel(nn.Module):
    """w = scale * q (+ zero) per 32 inputs, q int8; one aten int8 weight-only GEMM per group (NOTE 2)."""

    qg: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        super().__init__()
        n, k = q.shape
        self.n, self.k, self.groups = n, k, k // GROUP
        self.register_buffer("qg", q.to(torch.int8).reshape(n, self.groups, GROUP).transpose(0, 1).contiguous())
        # float16 holds a GGUF scale exactly (rows() stays exact); the GEMM gets a bfloat16 copy per call.
        self.register_buffer("scale", scale.t().contiguous().to(torch.float16))  # [groups, N]
        self.register_buffer("zero", None if zero is None else zero.float().t().contiguous())  # [groups, N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.groups, GROUP).to(_ACT)
        y = torch.zeros(flat.shape[0], self.n, dtype=torch.float32, device=x.device)
        scale = self.scale.to(_ACT)
        for g in range(self.groups):
            y += torch.ops.aten._weight_int8pack_mm(flat[:, g].contiguous(), self.qg[g], scale[g]).float()
        if self.zero is not None:  # sum_i (s q_i + z) x_i = s (q . x) + z * sum_i x_i
            y += x.reshape(-1, self.groups, GROUP).float().sum(-1) @ self.zero
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.qg[:, ids].float()  # [groups, T, 32]
        w = q * self.scale[:, ids].float().unsqueeze(-1)
        if self.zero is not None:
            w = w + self.zero[:, ids].unsqueeze(-1)
        return w.transpose(0, 1).reshape(len(ids), self.k)


class TritonKernel(nn.Module):
    """The GGUF blocks as stored in the file (uint8 [N, bytes per row] on the GPU), run by gguf/triton_gemm.py."""

    blocks: torch.Tensor

    def __init__(self, data: torch.Tensor, ggml_type: int, shape: tuple[int, int], device: torch.device) -> None:
        super().__init__()
        from pagedllm.plugins.quantization.gguf import triton_gemm as gguf_triton

        self.register_buffer("blocks", data.to(device).contiguous())
        self.ggml_type = int(ggml_type)
        self.n, self.k = shape
        self._triton = gguf_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._triton.gguf_matmul(x, cast(torch.Tensor, self._buffers["blocks"]), self.ggml_type, self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows W[ids] (float32, exact): the picked rows' blocks through the dequantize kernel."""
        picked = self.blocks[ids.to(self.blocks.device)]
        return self._triton.gguf_dequantize(picked, self.ggml_type, self.k, torch.float32)


class DequantKernel(nn.Module):
    """Any GGUF type: the blocks stay resident and are dequantized per call (or once, when `cache`)."""

    blocks: torch.Tensor
    fallback_reason: str | None = None  # set when a faster kernel was refused (gguf_method.make_kernel)

    def __init__(self, data: torch.Tensor, ggml_type: object, shape: tuple[int, int], cache: bool) -> None:
        super().__init__()
        from pagedllm.api.loading import dequantize_blocks

        self._dequantize = functools.partial(dequantize_blocks, ggml_type=cast(Any, ggml_type), shape=shape)
        self.register_buffer("blocks", data.contiguous())
        self.cache = cache
        self._cached: torch.Tensor | None = None

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self._cached is not None:
            return self._cached
        w = self._dequantize(self.blocks.cpu()).to(device=self.blocks.device, dtype=dtype)
        if self.cache:
            self._cached = w
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(x.dtype))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        picked = self.blocks[ids.to(self.blocks.device)].cpu()
        shape = (len(ids), self._dequantize.keywords["shape"][1])
        return self._dequantize(picked, shape=shape).to(self.blocks.device)


class DenseKernel(nn.Module):
    """A float matrix (F32/F16/BF16 in the file), kept in the model dtype."""

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()
