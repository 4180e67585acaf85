"""Tile sizes for the fused-MoE Triton kernels (fused_moe_triton.py): a small table keyed by how many rows
each expert gets on average, and a way to override it.

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

NOTE 2 (the values): measured, not guessed. `examples/gpu/bench_fused_moe.py --sweep` timed ten tile
configs (CUDA-graph replays, H200, bf16) on Mixtral (E=8, K=2) and gpt-oss-20b (E=32, K=4) at 1-256 tokens,
and each row below is the config within noise of the fastest at every measured rows-per-expert inside its
bound: BLOCK_M 16 with wide K tiles up to 2 rows an expert (the weights stream once; the tensor cores idle
anyway), BLOCK_M 32 up to 16 (Mixtral at 64 tokens: 675 us against 765 us with BLOCK_M 16), 64 x 256 tiles
with 8 warps and a narrower down GEMM up to 48, 128 x 256 beyond (Mixtral at 256 tokens: 816 us against
889 us with 64 x 128). Below ~1 row an expert the configs differ by less than the run-to-run noise (~5 %).
The rows were then checked on MoE shapes the sweep never saw (docs/benchmarks.md, "Fused MoE on the H200").
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


# (rows per expert at most, config); the last row takes everything larger (NOTE 2).
DEFAULT_TABLE: tuple[tuple[float, MoeKernelConfig], ...] = (
    (2, MoeKernelConfig(16, 128, 128, group_m=16, num_warps=4, num_stages=4)),
    (16, MoeKernelConfig(32, 128, 128, group_m=16, num_warps=4, num_stages=3)),
    (48, MoeKernelConfig(64, 256, 64, group_m=8, num_warps=8, num_stages=3, down_block_n=128)),
    (float("inf"), MoeKernelConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3)),
)

_OVERRIDE: ContextVar[MoeKernelConfig | None] = ContextVar("pagedllm_fused_moe_config", default=None)


def config_for(tokens: int, top_k: int, num_experts: int) -> MoeKernelConfig:
    """The config a fused_moe call of this size launches with: the override if one is set, else the table's
    row for the average rows per expert (NOTE 1)."""
    forced = _OVERRIDE.get()
    if forced is not None:
        return forced
    rows_per_expert = tokens * top_k / max(1, num_experts)
    return next(cfg for bound, cfg in DEFAULT_TABLE if rows_per_expert <= bound)


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
