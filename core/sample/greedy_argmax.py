"""Which argmax a greedy batch takes: the one-launch Triton kernel (argmax_kernel.py), chunk maxima, or torch's.

    the Triton kernel where:
    logits on CUDA, triton present      (not on the CPU: the interpreter is for tests only)
    [B, V], V contiguous, 16/32-bit     bf16, fp16 or float32 logits
    V >= MIN_VOCAB                      a vocabulary wide enough that torch's one-block reduce of a row is slow
                                        (29 us for 128,256 logits on the H200, argmax_kernel.py)
    B <= MAX_ROWS                       many rows give torch a block each; there it is already parallel

    chunk maxima first (NOTE 1) where the logits are on the CPU, V >= MIN_VOCAB; torch's argmax elsewhere

Every path gives the same index: the lowest among the maxima, a NaN before any number (argmax_kernel NOTE 1).
This module imports no triton: the kernel module is imported on the first CUDA call.

NOTE 1: torch's CPU argmax walks each row with a scalar index comparison, while its amax is a vectorized
reduction: on a 2-core Zen 4 a [128, 49152] float32 argmax took 4.7 ms against 0.44 ms for amax (2026-12-03),
about 3 % of a 128-request SmolLM2 decode step. So the CPU takes the amax of each CPU_CHUNK-wide chunk, the
first chunk holding the row's maximum (torch's argmax over the few chunk maxima: the first of equals, a NaN
first), and the argmax inside that chunk; a last partial chunk is compared after, winning only when strictly
greater (or a NaN over a number), so ties keep the lower index. 0.74 ms there, 88 -> 37 us for one row.
"""

from __future__ import annotations

import torch

from pagedllm.layers.fused_ops import triton_available

MIN_VOCAB = 8192
MAX_ROWS = 64
CPU_CHUNK = 1024  # NOTE 1
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 = logits.argmax(dim=-1) for [B, V] logits, through the chunked kernel where the rule says."""
    if (logits.device.type == "cuda" and logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype in _DTYPES
            and logits.shape[1] >= MIN_VOCAB and 1 <= logits.shape[0] <= MAX_ROWS and triton_available()):
        from pagedllm.sample.argmax_kernel import argmax_rows

        return argmax_rows(logits)
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] >= MIN_VOCAB and logits.shape[0] >= 1:
        return _chunked_argmax(logits)
    return logits.argmax(dim=-1)


def _chunked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) from chunk maxima (NOTE 1): the same index, a tie's lowest, a NaN's first."""
    rows, vocab = logits.shape
    n = vocab // CPU_CHUNK
    main = logits[:, : n * CPU_CHUNK].reshape(rows, n, CPU_CHUNK)
    chunk_max = main.amax(dim=-1)  # [B, n]
    chunk = chunk_max.argmax(dim=-1)  # [B]: the first chunk holding the maximum
    at = torch.arange(rows)
    index = main[at, chunk].argmax(dim=-1) + chunk * CPU_CHUNK
    if vocab % CPU_CHUNK:
        tail = logits[:, n * CPU_CHUNK :]
        tail_index = tail.argmax(dim=-1)
        tail_value, best = tail[at, tail_index], chunk_max[at, chunk]
        later_wins = (tail_value > best) | (tail_value.isnan() & ~best.isnan())
        index = torch.where(later_wins, tail_index + n * CPU_CHUNK, index)
    return index
