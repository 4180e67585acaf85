"""Tile sizes for the fused-MoE Triton kernels (fused_moe_triton.py): a rule from how many rows each expert
gets on average to BLOCK_M, a config per BLOCK_M, and a way to override them.

    config_for(tokens, top_k, num_experts)   the table's pick for one call
    with override_config(MoeKernelConfig(...)):   every fused_moe call inside uses that config instead

Light module (no triton): the benchmark and the tests import it to name configs.

NOTE 1 (the key): the grouped GEMM runs one [BLOCK_M, BLOCK_N] tile per (expert block, column block), so the
tile that fits is set by the rows per expert, tokens * top_k / num_experts, not by the token count alone:
64 tokens are 16 rows an expert for Mixtral (E=8, K=2) but 8 for gpt-oss-20b (E=32, K=4). A BLOCK_M much
larger than the rows an expert gets multiplies padding rows (pure waste of tensor-core work); a small one
re-reads each expert's weights once per block. vLLM keys its tuned tables by the token count per (E, N) shape
instead; ours has one table for every shape, so it keys by the quantity that shape-independently sets the
padding.

NOTE 2 (the rule and the values): measured, not guessed. `examples/gpu/bench_fused_moe.py --sweep` timed
ten tile configs (CUDA-graph replays, H200, bf16) on four MoE shapes -- Mixtral (E=8, K=2, I=14336),
gpt-oss-20b (E=32, K=4, I=2880), Qwen3-30B-A3B (E=128, K=8, I=768), DeepSeek-V2-Lite (E=64, K=6, I=1408) --
at 1-256 tokens. At every point the fastest BLOCK_M (or one within noise of it) was the largest power of two
at most twice the mean rows per expert: random routing spreads the rows, so a block about twice the mean
holds a busy expert in one block (Mixtral at 64 tokens, 16 rows an expert: 675 us with BLOCK_M 32 against
773 us with 16), while a block much larger than that multiplies padding rows (DeepSeek-V2-Lite at 256
tokens, 24 rows an expert: 305 us with 32, 326 us with 64). Each BLOCK_M's other fields are its fastest
companions in the same sweep: wide K tiles at 16 (the weights stream once; the tensor cores idle anyway),
64 x 256 with 8 warps and a narrower down GEMM at 64, 128 x 256 at 128. The rule was then checked on MoE
shapes it was not derived from (docs/benchmarks.md, "Fused MoE on the H200").
BLOCK_N counts the gate/up kernel's two halves together (fused_moe_triton NOTE 2), so its register and
shared-memory footprint equals vLLM's w13 GEMM tile of the same numbers. Shared memory stays under the
H200's 227 KB: stages * (BLOCK_M * BLOCK_K + BLOCK_K * BLOCK_N) * 2 bytes <= 148 KB for every row below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


@dataclasses.dataclass(frozen=True)
class MoeKernelConfig:
    """One launch configuration, shared by both grouped GEMMs of a call (one alignment serves both)."""

    block_m: int  # rows of a tile; each expert's rows are padded to a multiple of it
    block_n: int  # output columns of a tile (gate/up kernel: gate and up halves together, NOTE 2)
    block_k: int  # reduction step
    group_m: int = 1  # row blocks walked together per column sweep (L2 reuse of the weight tiles)
    num_warps: int = 4
    num_stages: int = 3
    # The down GEMM's output columns, where they should differ from block_n: its N is H, often smaller than
    # I, so at decode sizes block_n leaves SMs idle (H=4096 / 128 = 32 column blocks per row block).
    down_block_n: int | None = None

    def __post_init__(self) -> None:
        # tl.dot takes tiles of at least 16 on each side; the gate/up kernel splits block_n in two halves.
        for name, least in (("block_m", 16), ("block_n", 32), ("block_k", 16), ("down_block_n", 16)):
            value = getattr(self, name)
            if value is None:
                continue
            if value < least or value & (value - 1):
                raise ValueError(f"MoeKernelConfig.{name} must be a power of two >= {least}, got {value}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"MoeKernelConfig: group_m, num_warps and num_stages must be >= 1 ({self})")


# BLOCK_M -> the config launched with it (NOTE 2).
DEFAULT_TABLE: dict[int, MoeKernelConfig] = {
    16: MoeKernelConfig(16, 128, 128, group_m=16, num_warps=4, num_stages=4),
    32: MoeKernelConfig(32, 128, 128, group_m=16, num_warps=4, num_stages=3),
    64: MoeKernelConfig(64, 256, 64, group_m=8, num_warps=8, num_stages=3, down_block_n=128),
    128: MoeKernelConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3),
}


def block_m_for(rows_per_expert: float) -> int:
    """The largest power of two at most twice the mean rows an expert gets, within 16..128 (NOTE 2)."""
    block_m = 16
    while block_m < 128 and 2 * block_m <= 2 * rows_per_expert:
        block_m *= 2
    return block_m


_OVERRIDE: ContextVar[MoeKernelConfig | None] = ContextVar("pagedllm_fused_moe_config", default=None)


def config_for(tokens: int, top_k: int, num_experts: int) -> MoeKernelConfig:
    """The config a fused_moe call of this size launches with: the override if one is set, else the table's
    row for the average rows per expert (NOTE 1)."""
    forced = _OVERRIDE.get()
    if forced is not None:
        return forced
    return DEFAULT_TABLE[block_m_for(tokens * top_k / max(1, num_experts))]


@contextmanager
def override_config(config: MoeKernelConfig) -> Iterator[None]:
    """Every fused_moe call inside the block (this thread / task) launches with `config` (tuning, tests)."""
    if not isinstance(config, MoeKernelConfig):
        raise TypeError(f"override_config takes a MoeKernelConfig, got {type(config).__name__}")
    token = _OVERRIDE.set(config)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)
