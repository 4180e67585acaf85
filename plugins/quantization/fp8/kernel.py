"""One-pass FP8 (e4m3) activation quantization for the W8A8 path: per-token (dynamic) or a static scale.

    dynamic:  a[m] = max(max_k |x[m, k]| / 448, 1e-12),   x_q[m, k] = e4m3(clamp(x[m, k] / a[m], +-448))
    static:   a[m] = the checkpoint's input scale,         x_q as above

the torch code in fp8/method.py (quantize_activations_torch), bit for bit: the same float32 divisions
(IEEE-rounded: div_rn, not the approximate division `/` compiles to), the same clamp, round to nearest even.
One program per row: the row is read once into registers (up to MAX_SINGLE_PASS elements; longer rows are
read twice, the second time from L2), its absmax reduced, then quantized and written with its scale. That is
one read of x and one write of x_q and a, where the torch code makes ~5 passes over float32 copies of x.

NOTE 1: the float32 -> e4m3 rounding is done here (_round_to_e4m3, the approach of
plugins/attention/triton/kernels.py) so the final cast is exact: Triton's CPU interpreter rounds that cast
half-up and loses the carry when rounding crosses a power of two. On the GPU it costs a few integer ops in a
memory-bound kernel and keeps one code path. The sign is copied bitwise, so -0.0 stays -0.0 as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
MAX_SINGLE_PASS = 16384  # elements of a row held in registers at once (64 per thread at 8 warps)


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32 (NOTE 1).

    The step is 2^(e - 3) in the binade 2^e (3 mantissa bits), 2^-9 below 2^-6 (subnormals); adding and
    removing 1.5 * 2^23 * step rounds to it in float32's own round-to-nearest-even.
    """
    bits = x.to(tl.int32, bitcast=True)
    mag = tl.abs(x)
    exp = ((bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, -6) - 3
    magic = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    rounded = (mag + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_block(x, scale, FP8_MAX: tl.constexpr):
    q = tl.div_rn(x, scale)
    return _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))


@triton.jit
def _per_token_fp8_kernel(
    x_ptr, q_ptr, a_ptr, static_ptr,
    K, stride_xm, stride_qm,
    STATIC: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    q_ty = q_ptr.dtype.element_ty
    if SINGLE_PASS:
        ok = offs < K
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
        tl.store(q_row + offs, _quantize_block(x, scale, FP8_MAX).to(q_ty), mask=ok)
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                ok = k0 + offs < K
                x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
        for k0 in range(0, K, BLOCK):
            ok = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _quantize_block(x, scale, FP8_MAX).to(q_ty), mask=ok)
    tl.store(a_ptr + row, scale)


def quantize_per_token(
    x: torch.Tensor, static_scale: torch.Tensor | None = None, max_single_pass: int = MAX_SINGLE_PASS
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (x_q [M, K] float8_e4m3fn, a [M, 1] float32); see the module doc.

    `static_scale`: a one-element float32 tensor (the static input scale), else per-token scales.
    """
    from pagedllm.plugins.quantization.fp8.method import _MIN_SCALE, FP8_MAX

    assert x.dim() == 2 and x.stride(-1) == 1, (tuple(x.shape), x.stride())
    m, k = x.shape
    x_q = torch.empty(m, k, dtype=FP8, device=x.device)
    a = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, a
    block = triton.next_power_of_2(k)
    single = block <= max_single_pass
    if not single:
        block = triton.next_power_of_2(max_single_pass)
    _per_token_fp8_kernel[(m,)](
        x, x_q, a, static_scale if static_scale is not None else a,
        k, x.stride(0), x_q.stride(0),
        STATIC=static_scale is not None,
        SINGLE_PASS=single,
        BLOCK=block,
        FP8_MAX=FP8_MAX,
        MIN_SCALE=_MIN_SCALE,
        num_warps=8 if block >= 4096 else 4,
    )
    return x_q, a
