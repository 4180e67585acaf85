"""The fused CPU ops of cpu_ops.c, loaded with ctypes: add+RMSNorm, neox rotary, SiLU-and-mul, decode attention.

    cpu_ops()            -> CpuOps, or None with `unavailable_reason()` saying why (no C compiler, a failed
                            build, PAGEDLLM_CPU_OPS=0); the layers then run their torch code
    CpuOps.add_rms_norm / rotary_neox / silu_and_mul / decode_attention: float32 CPU tensors only (the
                            decode attention's KV cache float32 or bfloat16)
    CpuOps.silu_and_mul_bf16 / top_k: the bf16 batch GEMMs' activation and the LM head's candidates
                            (the gguf method's own use, not the CpuFusedOps protocol)

The gguf method brings them (GGUFConfig.cpu_fused_ops, a quantization config's optional member) and the
engine builder hands them to a float32 CPU model's layers at construction (KernelOptions.cpu_ops): they are
not bit-identical to torch (cpu_ops.c NOTE 1), so only where no bit-exact float reference is promised.
`norm_fn`, `rotary_fn`, `silu_fn` and `attn_fn` are the C functions themselves (argtypes set), for a model's
per-step plan that binds its pointers once (the CpuFusedOps protocol, pagedllm.protocols.quantization).

NOTE 1: every wrapper is on the per-token path (~8 calls per layer): arguments go to ctypes as plain ints
from `data_ptr()`, argtypes are set once, and shape checks are left to the callers that know their layout.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedllm.api.kernels import load_native

SOURCE = Path(__file__).with_name("cpu_ops.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_DISABLE_ENV = "PAGEDLLM_CPU_OPS"
_reason: str | None = None


class CpuOps:
    """Typed wrappers around cpu_ops.c (NOTE 1); implements pagedllm.api.quantization.CpuFusedOps."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self.norm_fn = lib.cpu_add_rms_norm
        self.norm_fn.argtypes = [p, p, p, f32, c_int, i64, i64, p, p]
        self.norm_fn.restype = None
        self.rotary_fn = lib.cpu_rotary_neox
        self.rotary_fn.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, p, p, i64]
        self.rotary_fn.restype = None
        # The same two ops with a thread count: a prefill chunk's rows shared over torch's threads (cpu_ops.c
        # NOTE 12); `norm_fn` / `rotary_fn` stay the single-threaded entry points a decode plan binds.
        self._norm_mt_fn = lib.cpu_add_rms_norm_mt
        self._norm_mt_fn.argtypes = [p, p, p, f32, c_int, i64, i64, p, p, c_int]
        self._norm_mt_fn.restype = None
        self._rotary_mt_fn = lib.cpu_rotary_neox_mt
        self._rotary_mt_fn.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, p, p, i64, c_int]
        self._rotary_mt_fn.restype = None
        self.silu_fn = lib.cpu_silu_and_mul
        self.silu_fn.argtypes = [p, i64, i64, p]
        self.silu_fn.restype = None
        self.attn_fn = lib.cpu_decode_attention
        self.attn_fn.argtypes = [p, i64, p, i64, p, i64, p, i64, i64, i64, i64, i64, p, p, i64, p, i64, f32, i64,
                               f32, p, c_int, c_int]
        self.attn_fn.restype = c_int
        self._silu_bf16_fn = lib.cpu_silu_and_mul_bf16
        self._silu_bf16_fn.argtypes = [p, i64, i64, p, c_int]
        self._silu_bf16_fn.restype = None
        self._top_k_fn = lib.cpu_top_k
        self._top_k_fn.argtypes = [p, i64, i64, i64, p, c_int]
        self._top_k_fn.restype = c_int
        self._step_fn = lib.cpu_decode_step
        self._step_fn.argtypes = [ctypes.POINTER(_StepArgs)]
        self._step_fn.restype = c_int

    def bind_decode_step(self, spec: dict[str, Any]) -> Callable[..., None]:
        """A Llama model's whole one-token decode step as one C call (cpu_ops.c NOTE 5), every pointer that does
        not change between steps bound now; the returned call takes the step's (x, positions, slots,
        block_table, block_table_stride, seq_lens, threads, out) addresses and raises as the ops do.

        `spec` (a model's per-step plan builds it; addresses are ints): `layers`, one dict per layer with
        norm1 / eps1 / gemma1, norm2 / eps2 / gemma2, the row products of qkv, o, gate_up and down as lists of
        (function address, type, weights, n, k, x, y) -- C functions with gguf_matmul's signature, pieces at
        their column offsets -- scale, window, soft_cap and cache (the layer's KV cache); and hidden, inter,
        nh, nkv, head, num_blocks, block_size, cos, sin, half, the scratch buffers qkv, attn_out, normed,
        mlp_in, gate_up, act, o_out, down, residual (two), final_norm / final_eps / final_gemma, and kv_bf16
        (the caches hold bf16: cpu_ops.c NOTE 9).
        """
        layers = spec["layers"]
        products: list[tuple[int, ...]] = []
        rows = (_Layer * len(layers))()
        for row, layer in zip(rows, layers, strict=True):
            starts = []
            for name in ("qkv", "o", "gate_up", "down"):
                starts.append(len(products))
                products.extend(layer[name])
            row.norm1, row.eps1, row.gemma1 = layer["norm1"], layer["eps1"], layer["gemma1"]
            row.norm2, row.eps2, row.gemma2 = layer["norm2"], layer["eps2"], layer["gemma2"]
            row.qkv, row.o, row.gate_up, row.down = starts
            row.end = len(products)
            row.scale, row.soft_cap, row.window, row.cache = layer["scale"], layer["soft_cap"], layer["window"], layer["cache"]
        product_rows = (_Product * len(products))(*(_Product(*p) for p in products))
        args = _StepArgs(layers=rows, num_layers=len(layers), products=product_rows)
        for name in ("hidden", "inter", "nh", "nkv", "head", "num_blocks", "block_size", "cos", "sin", "half",
                     "qkv", "attn_out", "normed", "mlp_in", "gate_up", "act", "o_out", "down", "final_norm",
                     "final_eps", "final_gemma", "kv_bf16"):
            setattr(args, name, spec[name])
        args.residual = (ctypes.c_void_p * 2)(*spec["residual"])
        keep = (rows, product_rows)  # the arrays the struct points into live as long as the call
        step, ref = self._step_fn, ctypes.byref(args)

        def run(x: int, positions: int, slots: int, table: int, table_stride: int, seq_lens: int, threads: int,
                out: int, _keep: tuple[Any, ...] = keep) -> None:
            args.x, args.positions, args.slots, args.block_table = x, positions, slots, table
            args.block_table_stride, args.seq_lens, args.threads, args.out = table_stride, seq_lens, threads, out
            rc = step(ref)
            if rc == -1:
                raise MemoryError("cpu_decode_attention: out of memory")
            if rc:
                raise ValueError("cpu_decode_step: a row product's type is not supported")

        return run

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x + residual) * w, x + residual); residual None: (norm(x) * w, None). [..., H] float32."""
        x = x.contiguous()
        out = torch.empty_like(x)
        h = x.shape[-1]
        threads = torch.get_num_threads()
        if residual is None:
            self._norm_mt_fn(x.data_ptr(), None, weight.data_ptr(), eps, gemma, x.numel() // h, h, out.data_ptr(),
                             None, threads)
            return out, None
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
        self._norm_mt_fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, gemma, x.numel() // h, h,
                         out.data_ptr(), new_residual.data_ptr(), threads)
        return out, new_residual

    def rotary_neox(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_size: int,
    ) -> None:
        """Rotate query [T, nq * hs] and key [T, nk * hs] in place (rows may be strided, each row contiguous);
        cos / sin [max_position, rotary_dim / 2] float32, positions [T] int64 (contiguous)."""
        t = query.shape[0]
        self._rotary_mt_fn(query.data_ptr(), query.stride(0), query.shape[-1] // head_size, key.data_ptr(),
                           key.stride(0), key.shape[-1] // head_size, head_size, t, positions.data_ptr(),
                           cos.data_ptr(), sin.data_ptr(), cos.shape[-1], torch.get_num_threads())

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2d] -> [T, d]: silu(gate) * up."""
        x = x.contiguous()
        d = x.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], d)
        self.silu_fn(x.data_ptr(), x.numel() // (2 * d), d, out.data_ptr())
        return out

    def silu_and_mul_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2d] bf16 (contiguous) -> [T, d] bf16: silu(gate) * up in float32, rounded once (cpu_ops.c NOTE 7);
        rows shared over torch's threads for a large T."""
        t, d = x.shape[0], x.shape[1] // 2
        out = torch.empty(t, d, dtype=torch.bfloat16)
        self._silu_bf16_fn(x.data_ptr(), t, d, out.data_ptr(), torch.get_num_threads())
        return out

    def top_k(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """[T, n] float32 (contiguous) -> [T, k] int64: each row's k (<= 64) largest values' indices, in no set
        order (cpu_ops.c NOTE 8)."""
        t, n = x.shape
        idx = torch.empty(t, k, dtype=torch.int64)
        if self._top_k_fn(x.data_ptr(), t, n, k, idx.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"cpu_top_k: k {k} outside 1..min({n}, 64)")
        return idx

    def decode_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None,
        soft_cap: float | None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """Write key/value [D, nkv, hs] at slots, then attend query [D, nh, hs] over each request's blocks.

        query, key and value float32; kv_cache [2, num_blocks, block_size, nkv, hs] contiguous, float32 or
        bfloat16 (key and value rounded to bf16 as they are written, widened as they are read: cpu_ops.c NOTE 9);
        slots [D] int64, block_table [D, *] int32 and seq_lens [D] int32, contiguous rows. Returns [D, nh, hs]
        float32. A large batch's requests are shared out over `threads` (default torch's thread count;
        cpu_ops.c NOTE 6), with the same bits.
        """
        d, nh, hs = query.shape
        _, num_blocks, block_size, nkv, _ = kv_cache.shape
        out = torch.empty(d, nh, hs)
        rc = self.attn_fn(query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
                        value.stride(0), kv_cache.data_ptr(), num_blocks, block_size, nkv, hs, nh,
                        slots.data_ptr(), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), d,
                        scale, window or 0, soft_cap or 0.0, out.data_ptr(),
                        torch.get_num_threads() if threads is None else threads, kv_cache_is_bf16(kv_cache))
        if rc:
            raise MemoryError("cpu_decode_attention: out of memory")
        return out


def kv_cache_is_bf16(kv_cache: torch.Tensor) -> int:
    """cpu_decode_attention's kv_bf16 flag for this cache: 1 for bfloat16, 0 for float32; other dtypes raise."""
    if kv_cache.dtype == torch.bfloat16:
        return 1
    if kv_cache.dtype == torch.float32:
        return 0
    raise ValueError(f"cpu_decode_attention: a float32 or bfloat16 KV cache, not {kv_cache.dtype}")


_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Product(ctypes.Structure):
    """cpu_ops.c's cpu_row_product."""

    _fields_ = [("fn", _p), ("type", _i64), ("w", _p), ("n", _i64), ("k", _i64), ("x", _p), ("y", _p)]


class _Layer(ctypes.Structure):
    """cpu_ops.c's cpu_decode_layer."""

    _fields_ = [("norm1", _p), ("norm2", _p), ("eps1", _f32), ("eps2", _f32), ("gemma1", _i64), ("gemma2", _i64),
                ("qkv", _i64), ("o", _i64), ("gate_up", _i64), ("down", _i64), ("end", _i64),
                ("scale", _f32), ("soft_cap", _f32), ("window", _i64), ("cache", _p)]


class _StepArgs(ctypes.Structure):
    """cpu_ops.c's cpu_decode_step_args."""

    _fields_ = [("layers", ctypes.POINTER(_Layer)), ("num_layers", _i64), ("products", ctypes.POINTER(_Product)),
                ("threads", ctypes.c_int), ("hidden", _i64), ("inter", _i64),
                ("x", _p), ("positions", _p), ("slots", _p), ("block_table", _p), ("block_table_stride", _i64),
                ("seq_lens", _p), ("nh", _i64), ("nkv", _i64), ("head", _i64), ("num_blocks", _i64),
                ("block_size", _i64), ("cos", _p), ("sin", _p), ("half", _i64),
                ("qkv", _p), ("attn_out", _p), ("normed", _p), ("mlp_in", _p), ("gate_up", _p), ("act", _p),
                ("o_out", _p), ("down", _p), ("residual", _p * 2),
                ("final_norm", _p), ("final_eps", _f32), ("final_gemma", _i64), ("out", _p), ("kv_bf16", _i64)]


@functools.cache
def cpu_ops() -> CpuOps | None:
    """The compiled ops, or None (then `unavailable_reason()` says why). Built and loaded once."""
    global _reason
    lib, _reason = load_native(SOURCE, FLAGS, _DISABLE_ENV, "torch's ops")
    if lib is None:
        return None
    return CpuOps(lib)


def unavailable_reason() -> str | None:
    """Why `cpu_ops()` returned None (None if it has not, or has not been asked yet)."""
    return _reason
