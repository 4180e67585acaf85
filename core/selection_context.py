"""Light, frozen descriptions of what a component must serve; plugins' check() functions read these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSelectionContext:
    device_type: str  # "cpu" or "cuda"
    compute_capability: tuple[int, int] | None  # None off CUDA
    dtype: str  # "float32", "float16", "bfloat16"
    kv_cache_dtype: str  # "auto" (= dtype) or e.g. "fp8_e4m3"
    head_size: int
    block_size: int
    sliding_window: bool = False
    logits_soft_cap: bool = False
    cuda_graphs: bool = False
