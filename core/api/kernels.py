"""pagedllm.api.kernels: The kernel toolkit: launches that compile ahead of time, NVRTC loading of CUDA C, native CPU builds, PDL,
split-K helpers, the shared paged-cache write, and the dense decode GEMV (16-bit or FP8 weights) with its rule. Importing this module imports torch; the Triton pieces import
triton only when their modules are first used.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.layers.compile_ahead import launch
from pagedllm.layers.cuda_rtc import RtcError, load_kernel
from pagedllm.layers.cuda_rtc import launch as launch_rtc
from pagedllm.layers.dense_gemv import DenseGemvBlocks, dense_linear, gated_dense_gemv, gemv_blocks, sm_count
from pagedllm.layers.fused_ops import triton_available
from pagedllm.layers.kv_cache_write import is_fp8, reshape_and_cache
from pagedllm.layers.native_build import load_native

if TYPE_CHECKING:
    from pagedllm.layers.dense_gemv_kernel import dense_gemv
    from pagedllm.layers.pdl import launch_dependents, pdl_on, prefetch_l2, wait_primary
    from pagedllm.layers.split_k import reduce_split, split_k, store_rows, tickets

# NOTE: these names are Triton device functions and import triton with their modules, so they load on first
# access: a plugin that imports `triton_available` from here must work on an install without triton (the
# CPU serving install, README's first command), where it is then False and the Triton names are never used.
_TRITON_NAMES = {
    "dense_gemv": "pagedllm.layers.dense_gemv_kernel",
    "launch_dependents": "pagedllm.layers.pdl", "pdl_on": "pagedllm.layers.pdl",
    "prefetch_l2": "pagedllm.layers.pdl", "wait_primary": "pagedllm.layers.pdl",
    "reduce_split": "pagedllm.layers.split_k", "split_k": "pagedllm.layers.split_k",
    "store_rows": "pagedllm.layers.split_k", "tickets": "pagedllm.layers.split_k",
}


def __getattr__(name: str) -> Any:
    module = _TRITON_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "DenseGemvBlocks",
    "RtcError",
    "dense_gemv",
    "dense_linear",
    "gated_dense_gemv",
    "gemv_blocks",
    "is_fp8",
    "launch",
    "launch_dependents",
    "launch_rtc",
    "load_kernel",
    "load_native",
    "pdl_on",
    "prefetch_l2",
    "reduce_split",
    "reshape_and_cache",
    "sm_count",
    "split_k",
    "store_rows",
    "tickets",
    "triton_available",
    "wait_primary",
]
