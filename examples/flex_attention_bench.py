"""CPU micro-benchmark: one layer's attention per step, flex (eager and compiled) against the torch backend.

    python examples/flex_attention_bench.py [--threads N] [--repeat N]

Shapes are a small model's (4 query heads, 2 KV heads, head 64, pages of 16) on three steps: 8 decodes over
512-token contexts, two fresh 256-token prompts, and 4 decodes beside a 200-token prompt. Compiled runs are
timed after their warm-up compile (reported apart: every new step shape compiles again).
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention.flex import FlexOptions
from pagedllm.plugins.attention.flex.backend import FlexAttentionBackend

HEADS, KV_HEADS, HEAD, PAGE = 4, 2, 64, 16
STEPS: dict[str, tuple[list[int], list[int]]] = {
    "decode 8 x 512": ([512] * 8, [1] * 8),
    "prefill 2 x 256": ([0, 0], [256, 256]),
    "mixed 4 decodes + 200": ([300] * 4 + [0], [1] * 4 + [200]),
}


def step_metadata(contexts: list[int], queries: list[int]) -> tuple[CommonAttentionMetadata, int]:
    """A step's common metadata (decodes first, consecutive block ids from 1) and the blocks it needs."""
    lens = [c + q for c, q in zip(contexts, queries, strict=True)]
    width = max(-(-n // PAGE) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    slots: list[int] = []
    nxt = 1
    for i, (c, n) in enumerate(zip(contexts, lens, strict=True)):
        count = -(-n // PAGE)
        table[i, :count] = torch.arange(nxt, nxt + count)
        slots += [int(table[i, p // PAGE]) * PAGE + p % PAGE for p in range(c, n)]
        nxt += count
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, seq_lens=seq, block_table=table, slot_mapping=torch.tensor(slots),
        query_start_loc_cpu=starts, seq_lens_cpu=seq, num_reqs=len(lens), num_actual_tokens=sum(queries),
        max_query_len=max(queries), max_seq_len=max(lens), block_size=PAGE,
        num_decodes=sum(1 for q in queries if q == 1),
    )
    return common, nxt


def _step(backend: Any, impl: Any, qkv: tuple[torch.Tensor, ...], cache: torch.Tensor,
          common: CommonAttentionMetadata) -> torch.Tensor:
    """One layer of one step, metadata included (the flex masks are built per step)."""
    return impl.forward(*qkv, cache, backend.build_metadata(common))  # type: ignore[no-any-return]


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds per call, after one untimed call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend

    layer = AttentionLayerConfig(HEADS, HEAD, KV_HEADS, HEAD**-0.5)
    backends = {
        "torch": TorchSDPABackend,
        "flex eager": FlexAttentionBackend.configure(FlexOptions(compile="never")),
        "flex compiled": FlexAttentionBackend.configure(FlexOptions(compile="always")),
    }
    for name, (contexts, queries) in STEPS.items():
        common, num_blocks = step_metadata(contexts, queries)
        tokens = common.num_actual_tokens
        q, k, v = (torch.randn(tokens, h, HEAD) for h in (HEADS, KV_HEADS, KV_HEADS))
        cache = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD)
        for label, backend in backends.items():
            run = functools.partial(_step, backend, backend.make_impl(layer), (q, k, v), cache, common)
            with torch.inference_mode():
                start = time.perf_counter()
                run()
                first = (time.perf_counter() - start) * 1e3
                per_call = timed(run, args.repeat)
            print(f"{name:24s} {label:14s} {per_call:9.2f} ms   (first call {first:8.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
