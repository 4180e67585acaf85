"""Registers the `flashinfer` attention backend: FlashInfer's paged decode and prefill wrappers (NVIDIA GPUs).

Light module: nothing here imports flashinfer or torch, so `pagedllm plugins` stays fast and can say why the
backend is unavailable (package missing, no CUDA, capability, dtype, head size) without loading it.

Rank (vLLM's order, vllm/platforms/cuda.py): on Blackwell (compute capability 10.x) FlashInfer comes first;
on Ampere/Hopper FlashAttention outranks it (the `flash_attn` plugin's priority_for); both sit above triton
-- except when the engine will capture decode CUDA graphs: then triton leads (EAGER_PRIORITY).

CUDA graphs: the backend now replays its pure-decode steps inside the runner's captured graphs, re-planning
FlashInfer's graph-mode decode wrappers before each replay (flashinfer_backend.py NOTE 3). That path is
verified on the CPU only, against a stand-in for the wrapper (tests/test_flashinfer_graphs.py); the rank under
graphs stays below triton until examples/gpu/flashinfer_graph_check.py has shown on a GPU that greedy tokens
match eager FlashInfer and triton and that graphs make decode faster -- then priority_for returns PRIORITY
(and tests/test_attention_selection.py's graph-engine expectation follows). Asked for by name
(`attention.backend: flashinfer`) it captures graphs already.
"""

from __future__ import annotations

from typing import Any

from pagedllm import hookimpl

# Head sizes FlashInfer's prebuilt and JIT decode/prefill templates cover (vLLM's FlashInfer backend list).
HEAD_SIZES = (64, 128, 256)
PRIORITY = 100  # above triton (50): on a GPU with flashinfer installed it is the faster path
EAGER_PRIORITY = 45  # decode CUDA graphs wanted (see priority_for); above flash_attn's 40 there


def _load() -> Any:
    from pagedllm.plugins.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend


def check(ctx: Any) -> list[str]:
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
    return reasons


def priority_for(ctx: Any) -> int:
    """PRIORITY, except below triton (50) when the engine captures decode CUDA graphs: the graph path
    (flashinfer_backend.py NOTE 3) awaits its first GPU run (see the module docstring)."""
    return EAGER_PRIORITY if ctx.cuda_graphs else PRIORITY


@hookimpl
def register_attention_backends(register: Any) -> None:
    register(
        "flashinfer", _load, priority=PRIORITY, requires=("flashinfer",), check=check,
        description="FlashInfer paged decode (tensor cores, in CUDA graphs) + prefill wrappers, planned once per step",
        priority_for=priority_for,
    )
