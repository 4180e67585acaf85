"""Which argmax a greedy batch takes: the one-launch Triton kernel (argmax_kernel.py) or torch's.

    logits on CUDA, triton present      (the CPU keeps torch: the interpreter is for tests only)
    [B, V], V contiguous, 16/32-bit     bf16, fp16 or float32 logits
    V >= MIN_VOCAB                      a vocabulary wide enough that torch's one-block reduce of a row is slow
                                        (29 us for 128,256 logits on the H200, argmax_kernel.py)
    B <= MAX_ROWS                       many rows give torch a block each; there it is already parallel

Both give the same index: the lowest among the maxima, a NaN before any number (argmax_kernel NOTE 1).
This module imports no triton: the kernel module is imported on the first CUDA call.
"""

from __future__ import annotations

import torch

from pagedllm.layers.fused_ops import triton_available

MIN_VOCAB = 8192
MAX_ROWS = 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64 = logits.argmax(dim=-1) for [B, V] logits, through the chunked kernel where the rule says."""
    if (logits.device.type == "cuda" and logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype in _DTYPES
            and logits.shape[1] >= MIN_VOCAB and 1 <= logits.shape[0] <= MAX_ROWS and triton_available()):
        from pagedllm.sample.argmax_kernel import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(dim=-1)
