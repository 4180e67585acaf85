"""Registers the `triton` attention backend: Triton paged-attention kernels for NVIDIA GPUs.

Light module: no triton or torch import here. The backend wins over `torch` wherever its check passes:
on CUDA, or on the CPU only under TRITON_INTERPRET=1 (the interpreter the CPU tests use) -- a normal CPU
run never picks a kernel the interpreter would run a thousand times slower than torch.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import AttentionSelectionContext, RegisterAttentionBackend, hookimpl


class TritonOptions(BaseModel):
    """`plugins.triton`: switches of the triton attention backend (validated, so a typo is an error)."""

    model_config = ConfigDict(extra="forbid")

    fresh_prefill: bool = Field(
        True, description="requests with nothing cached before the step (fresh prompts, first chunks) attend "
        "over the step's own K/V rows with TMA loads (triton/prefill.py) instead of the paged cache; false: "
        "every request through the unified paged kernel (A/B runs)"
    )
    fresh_prefill_min_tokens: int = Field(
        1024, ge=64, description="the fresh route is taken for a step whose fresh run's longest request has at "
        "least this many new tokens (64 at the least: smaller steps may be graph-captured). On the H200: W1 "
        "(1024-token prompts among ~480 decodes) +0.9 % end to end against 2048, its wave's attention 0.94 vs "
        "1.05 ms a layer; W5 unchanged at 512; long prompts 8 x 2048: 452 vs 333 TFLOP/s, 1 x 8192: 545 vs 418"
    )
    decode_big_min_seqs: int = Field(
        256, ge=0, description="decode-only steps (one token per request, one segment) of at least this many "
        "requests use 128-key tiles (triton/tuning.py NOTE 7: per kernel 1.5-5 % faster on the H200 at 288-512 "
        "requests, 13 % slower at 64 x 2048; end to end W2 +0.8 %, W5 +1.3 % with heads first); 0: never"
    )
    decode_heads_first: bool = Field(
        True, description="decode launches order their programs by request, then KV head (triton/tuning.py NOTE 8: "
        "1-2.5 % faster decode attention on the H200); false: by KV head, then request (A/B runs)"
    )

    split_decodes_min: int = Field(
        0, ge=0, description="a step with prompt tokens and at least this many decodes attends in two launches: "
        "the decodes with the decode configuration, the rest with its own (triton/backend.py NOTE 5); 0: one launch. "
        "On the H200 W1 ran 3.3 % slower split at 64 (its wave's attention 1.06 vs 1.05 ms a layer)"
    )


def _load() -> Any:
    from pagedllm.plugins.attention.triton.backend import TritonBackend

    return TritonBackend


def _check(ctx: AttentionSelectionContext) -> list[str]:
    reasons = []
    if ctx.device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        reasons.append(f"device {ctx.device_type}: needs cuda (or TRITON_INTERPRET=1 for the interpreter)")
    if ctx.device_type == "cuda" and ctx.compute_capability is not None and ctx.compute_capability < (8, 0):
        reasons.append(f"compute capability {ctx.compute_capability} < 8.0 (bf16 tensor-core dots)")
    if ctx.kv_cache_dtype not in ("auto", ctx.dtype, "fp8_e4m3"):
        reasons.append(f"kv cache dtype {ctx.kv_cache_dtype} not supported (the model dtype or fp8_e4m3)")
    elif ctx.kv_cache_dtype == "fp8_e4m3" and ctx.device_type == "cuda" and (ctx.compute_capability or (0, 0)) < (8, 9):
        # Triton's float8e4nv conversions need Ada/Hopper (sm_89+).
        reasons.append(f"fp8 kv cache needs compute capability >= 8.9, not {ctx.compute_capability}")
    if ctx.dtype not in ("float32", "float16", "bfloat16"):
        reasons.append(f"dtype {ctx.dtype} not supported")
    if ctx.head_size > 256:
        reasons.append(f"head size {ctx.head_size} > 256")
    if ctx.sinks:
        reasons.append("attention sinks not supported (the kernels have no sink term)")
    if ctx.chunked_local:
        reasons.append("chunked local attention not supported (the kernels mask causally or by a sliding window, "
                       "not by chunk; the torch and flex backends apply it)")
    return reasons


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    # Above torch (0): on a GPU the kernel is the fast path.
    register(
        "triton", _load, priority=50, requires=("triton",), check=_check, config_model=TritonOptions,
        description="Triton paged attention (unified prefill+decode, split-KV decode, TMA fresh prefill)",
    )
