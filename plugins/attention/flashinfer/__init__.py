"""Registers the `flashinfer` attention backend: FlashInfer's paged decode and prefill wrappers (NVIDIA GPUs).

Light module: nothing here imports flashinfer or torch, so `pagedllm plugins` stays fast and can say why the
backend is unavailable (package missing, no CUDA, capability, dtype, head size) without loading it.

Rank (vLLM's order, vllm/platforms/cuda.py): on Blackwell (compute capability 10.x) FlashInfer comes first;
on Ampere/Hopper FlashAttention outranks it (the `flash_attn` plugin's priority_for); both sit above triton
-- except when the engine will capture decode CUDA graphs: then triton leads (EAGER_PRIORITY, below).

CUDA graphs: the backend replays its pure-decode steps inside the runner's captured graphs, re-planning
FlashInfer's graph-mode decode wrappers before each replay (flashinfer/backend.py NOTE 3). On the H200
(examples/gpu/flashinfer_graph_check.py, docs/benchmarks.md) graph replays equal eager FlashInfer exactly,
greedy tokens with graphs equal eager, and W3 went 20.9 -> 4.93 ms/token -- but not past triton's graph
decode (4.87 ms/token; W2 at 0.25 scale 14,994 vs triton's ~15,000), while each replay costs 0.5-0.8 ms of
host plan() against triton's 0.1-0.2. So with graphs triton keeps the lead on measurement, not for want of
graphs; asked for by name (`attention.backend: flashinfer`) this backend captures them.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import AttentionSelectionContext, RegisterAttentionBackend, hookimpl

# Head sizes FlashInfer's prebuilt and JIT decode/prefill templates cover (vLLM's FlashInfer backend list).
HEAD_SIZES = (64, 128, 256)
PRIORITY = 100  # above triton (50): on a GPU with flashinfer installed it is the faster path
EAGER_PRIORITY = 45  # decode CUDA graphs wanted: below triton, measured no slower (module docstring)


def _load() -> Any:
    from pagedllm.plugins.attention.flashinfer.backend import FlashInferBackend

    return FlashInferBackend


def check(ctx: AttentionSelectionContext) -> list[str]:
    """Why FlashInfer cannot serve `ctx` (empty: it can). The package itself is checked through `requires`."""
    reasons = []
    if ctx.device_type != "cuda":
        reasons.append(f"device {ctx.device_type}: needs cuda")
    elif ctx.compute_capability is not None and ctx.compute_capability < (8, 0):
        reasons.append(f"compute capability {ctx.compute_capability} < 8.0")
    if ctx.dtype not in ("float16", "bfloat16"):
        reasons.append(f"dtype {ctx.dtype} not supported (float16/bfloat16 only)")
    if ctx.kv_cache_dtype not in ("auto", ctx.dtype, "fp8_e4m3"):
        reasons.append(f"kv cache dtype {ctx.kv_cache_dtype} not supported (the model dtype or fp8_e4m3)")
    elif (
        ctx.kv_cache_dtype == "fp8_e4m3"
        and ctx.device_type == "cuda"
        and (ctx.compute_capability or (0, 0)) < (8, 9)
    ):
        reasons.append(f"fp8 kv cache needs compute capability >= 8.9, not {ctx.compute_capability}")
    if ctx.head_size not in HEAD_SIZES:
        reasons.append(f"head size {ctx.head_size} not in {HEAD_SIZES}")
    if ctx.sinks:
        reasons.append("attention sinks not supported (this backend does not pass them to FlashInfer)")
    if ctx.chunked_local:
        reasons.append("chunked local attention not supported (this backend passes FlashInfer no chunk mask; the "
                       "torch and flex backends apply it)")
    return reasons


def priority_for(ctx: AttentionSelectionContext) -> int:
    """PRIORITY, except below triton (50) when the engine captures decode CUDA graphs: both then decode in
    graphs, and triton's measured as fast with less host work per step (module docstring)."""
    return EAGER_PRIORITY if ctx.cuda_graphs else PRIORITY


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    register(
        "flashinfer", _load, priority=PRIORITY, requires=("flashinfer",), check=check,
        description="FlashInfer paged decode (tensor cores, in CUDA graphs) + prefill wrappers, planned once per step",
        priority_for=priority_for,
    )
