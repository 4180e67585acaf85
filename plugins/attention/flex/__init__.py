"""Registers the `flex` attention backend: torch.nn.attention.flex_attention over the paged KV cache.

Light module: no torch import here (the backend imports it when the engine loads it).

Ranked below the `torch` reference (priority -10), so it is never picked unless asked for by name
(`attention: {backend: flex}`): measured on the CPU (docs/plugins/attention.md, tools in
examples/flex_attention_bench.py) it is slower than `torch` eagerly and no faster compiled, and it has not
been measured on a GPU against `triton` / `flash_attn`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import AttentionSelectionContext, RegisterAttentionBackend, hookimpl


class FlexOptions(BaseModel):
    """`plugins.flex`: how the flex backend runs flex_attention (validated, so a typo is an error)."""

    model_config = ConfigDict(extra="forbid")

    compile: Literal["auto", "always", "never"] = Field(
        "auto", description="torch.compile flex_attention (a fused, block-sparse kernel over the whole paged "
        "cache, compiled lazily on first use and once more per new shape) or run it eagerly (torch's unfused "
        "reference over the step's own blocks, gathered). auto: compiled on CUDA, eager elsewhere -- on the CPU "
        "a first compile takes ~30 s and every new step shape recompiles"
    )
    q_block_size: int = Field(
        16, ge=1, description="query rows per block-mask row: each row of the block mask lists the KV pages any "
        "of its queries may see (smaller: fewer pages visited per row, more rows)"
    )


def _load() -> Any:
    from pagedllm.plugins.attention.flex.backend import FlexAttentionBackend

    return FlexAttentionBackend


def _check(ctx: AttentionSelectionContext) -> list[str]:
    reasons = []
    if ctx.kv_cache_dtype not in ("auto", ctx.dtype):
        reasons.append(f"kv cache dtype {ctx.kv_cache_dtype} not supported (the model dtype only)")
    if ctx.dtype not in ("float32", "float16", "bfloat16"):
        reasons.append(f"dtype {ctx.dtype} not supported (float32, float16, bfloat16)")
    if ctx.device_type not in ("cpu", "cuda"):
        reasons.append(f"device {ctx.device_type}: runs on cpu or cuda")
    if ctx.sinks:
        reasons.append("attention sinks not supported (no score mod adds the sink column)")
    return reasons


@hookimpl
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    # Below torch (0): slower than the reference where measured (the module docstring); named, it runs.
    register(
        "flex", _load, priority=-10, check=_check, config_model=FlexOptions,
        description="torch flex_attention over the paged cache (block masks from the block tables)",
    )
