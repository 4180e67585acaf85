"""The Triton kernels of kv_cache_write.py (imported on first use, so that installs without triton -- the CPU
serving install -- can import the kernel toolkit)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in float32.

    NOTE: the cast that follows is then exact. On a GPU the hardware cast rounds the same way, so this costs
    a few integer ops in a memory-bound kernel; Triton's CPU interpreter, though, rounds half up and drops
    the carry when rounding crosses a power of two (0.4927 -> 0.25), which would make the interpreter tests
    disagree with torch. Rounding here keeps one code path for both. The step is 2^(e - 3) for a binade
    2^e (3 mantissa bits), 2^-9 below 2^-6 (subnormals); adding and removing 1.5 * 2^23 * step rounds to it.
    """
    mag = tl.abs(x)
    exp = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3
    magic = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    rounded = (mag + magic) - magic
    return tl.where(x < 0, -rounded, rounded)  # on the magnitude, so -tiny keeps torch's -0.0


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_slot, stride_c_h, inv_k_scale, inv_v_scale,
    HEAD: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # negative slot: a padding row that must not touch the cache
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < KV_HEADS * HEAD
    h = offs // HEAD
    d = offs % HEAD
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_c_slot + h * stride_c_h + d
    if FP8:
        # Quantize: scale into e4m3's range and saturate (a plain cast of |x| > 448 is not saturating on
        # every path; torch's CPU cast saturates, so clamping keeps both backends bit-identical).
        k = _round_to_e4m3(tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -448.0), 448.0))
        v = _round_to_e4m3(tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -448.0), 448.0))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)
