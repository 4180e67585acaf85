"""Writing new K/V rows into the paged cache on a GPU: one Triton kernel every CUDA attention backend shares.

The cache is the layout the engine allocates for attention layers (kv_cache [2, num_blocks, block_size,
kv_heads, head], K = [0], V = [1]; the NHD pages FlashInfer and FlashAttention also read), so writing it is
part of the KV layout's contract rather than any one backend's business: the triton, flashinfer and
flash_attn backends all call `reshape_and_cache`. The kernels (kv_cache_write_kernel.py) and triton are
imported on the first write: a CPU-only install without triton imports this module (pagedllm.api.kernels
re-exports it) and never writes through it.
"""

from __future__ import annotations

import torch

from pagedllm.layers.compile_ahead import launch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, kv_heads, head] (last dim contiguous) at slots [T] of the paged cache.

    An fp8 cache stores key / k_scale and value / v_scale, saturated to e4m3's +-448.
    """
    num_tokens, kv_heads, head = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.is_contiguous()
    import triton

    from pagedllm.layers.kv_cache_write_kernel import reshape_and_cache_kernel

    launch(
        reshape_and_cache_kernel, (num_tokens,),
        key, value, kv_cache, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), 1.0 / k_scale, 1.0 / v_scale,
        HEAD=head, KV_HEADS=kv_heads, BLOCK=triton.next_power_of_2(kv_heads * head),
        FP8=is_fp8(kv_cache.dtype),
    )


def is_fp8(dtype: torch.dtype) -> bool:
    """The KV-cache dtypes stored as 8-bit floats with a per-tensor scale."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
