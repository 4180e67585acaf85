"""The token bitmask applied to the logits in one Triton kernel (bitmask.py's accelerator path where Triton is).

Imported only where it is about to run: it imports triton. Compiled at the first masked step (not by the
engine's compile-ahead at start-up: most engines never mask), then from Triton's cache on disk.

NOTE: the unfused path (bitmask.forbidden_by_shifts, then masked_fill_) launches ~6 kernels and writes a
[rows, vocab] bool mask before it reads it back: measured on the H200 at 256 rows of a 49k vocabulary, the
step's sampling took 0.275 ms of GPU time with the masks and 0.055 ms without, ~2 % of a 10 ms decode step.
Here each program reads one row's words for a block of tokens and stores -inf where a bit is clear, without
reading the logits: one launch, and the logits' bytes are written only where a token is forbidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch

BLOCK = 4096


@triton.jit
def _apply_bitmask(logits_ptr, logits_stride, mask_ptr, mask_stride, logit_rows_ptr, mask_rows_ptr, vocab,
                   BLOCK: tl.constexpr, INDEXED: tl.constexpr):
    r = tl.program_id(0)
    if INDEXED:
        logit_row = tl.load(logit_rows_ptr + r).to(tl.int64)
        mask_row = tl.load(mask_rows_ptr + r).to(tl.int64)
    else:
        logit_row = r.to(tl.int64)
        mask_row = r.to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    words = tl.load(mask_ptr + mask_row * mask_stride + tokens // 32, mask=inside, other=-1)
    forbidden = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + logit_row * logits_stride + tokens, float("-inf"), mask=inside & forbidden)


def apply_bitmask_triton(logits: torch.Tensor, mask: torch.Tensor, logit_rows: torch.Tensor | None,
                         mask_rows: torch.Tensor | None) -> None:
    """logits[logit_rows[i], t] = -inf wherever bit t of mask[mask_rows[i]] is clear, in place. `mask` is the
    [rows, ceil(vocab / 32)] int32 bitmask on the logits' device; both index tensors (int64, on the device)
    or neither (row i of each)."""
    rows = mask.shape[0] if logit_rows is None else logit_rows.numel()
    if rows == 0:
        return
    vocab = logits.shape[-1]
    assert logits.stride(-1) == 1 and mask.stride(-1) == 1
    indexed = logit_rows is not None
    launch(_apply_bitmask, (rows, triton.cdiv(vocab, BLOCK)), logits, logits.stride(0), mask, mask.stride(0),
           logit_rows if indexed else mask, mask_rows if indexed else mask, vocab, BLOCK=BLOCK, INDEXED=indexed)
