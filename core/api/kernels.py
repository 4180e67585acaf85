"""pagedllm.api.kernels: The kernel toolkit: launches that compile ahead of time, NVRTC loading of CUDA C, native CPU builds, PDL,
split-K helpers, and the shared paged-cache write. Importing this module imports torch; the Triton pieces import
triton only when their modules are first used.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.layers.compile_ahead import launch
from pagedllm.layers.cuda_rtc import RtcError, load_kernel
from pagedllm.layers.cuda_rtc import launch as launch_rtc
from pagedllm.layers.fused_ops import triton_available
from pagedllm.layers.kv_cache_write import is_fp8, reshape_and_cache
from pagedllm.layers.native_build import load_native
from pagedllm.layers.pdl import launch_dependents, pdl_on, prefetch_l2, wait_primary
from pagedllm.layers.split_k import reduce_split, split_k, store_rows, tickets

__all__ = [
    "RtcError",
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
    "split_k",
    "store_rows",
    "tickets",
    "triton_available",
    "wait_primary",
]
