"""The batch token bitmask: its layout, allocation, and its application to the logits on the device.

Layout (xgrammar's and llguidance's): one row per masked logits row, ceil(vocab / 32) int32 words; bit j of
word w set = token 32 w + j may be sampled. A row of -1 allows everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.sample.metadata import to_device

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of `num_rows` rows, everything allowed (backends fill it in place)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


@dataclass
class GrammarBitmask:
    """One step's masks, carried by SchedulerOutput.structured_output from the engine core to the runner.

    `rows[req_id]` is the first row of the request's masks: one per logits row it samples this step (one,
    or, with drafts, one per draft position plus the bonus position, in order).
    """

    rows: dict[str, int]
    bitmask: torch.Tensor  # [num_rows, width] int32, CPU

    def apply(self, logits: torch.Tensor, req_ids: list[str], num_rows: list[int]) -> None:
        """Mask the logits rows of the structured-output requests among `req_ids` (each owning `num_rows`
        consecutive logits rows, in order), on the logits' device, outside any graph."""
        logit_rows: list[int] = []
        mask_rows: list[int] = []
        row = 0
        for rid, n in zip(req_ids, num_rows):
            first = self.rows.get(rid)
            if first is not None:
                logit_rows.extend(range(row, row + n))
                mask_rows.extend(range(first, first + n))
            row += n
        if logit_rows:
            apply_bitmask(logits, self.bitmask, logit_rows, mask_rows)


class DeferredBitmask:
    """A pipelined step's masks, filled once the runner holds the step before's sampled ids
    (structured_output/manager.py NOTE 3): `resolve(previous)` feeds those ids to the grammars and returns
    the step's GrammarBitmask. It lives in the engine core's process: a tensor-parallel rank that receives
    the step pickled gets None here, as it samples nothing (rank 0 samples and broadcasts the ids)."""

    def __init__(self, fill: Callable[[Any], GrammarBitmask | None],
                 ahead: Callable[[list[str], list[int], Callable[[], list[int]]], Callable[[], None] | None]
                 | None = None) -> None:
        self._fill = fill
        self._ahead = ahead

    def resolve(self, previous: Any) -> GrammarBitmask | None:
        """None when no request of the step still has a grammar (they all ended meanwhile)."""
        return self._fill(previous)

    def accept_ahead(self, req_ids: list[str], sample_rows: list[int],
                     fetch: Callable[[], list[int]]) -> Callable[[], None] | None:
        """Once this step is sampled: feed its ids (`fetch()`, callable from any thread, gives them in
        `sample_rows` order) to the grammars on the manager's worker thread, and fill the next step's rows
        there too (manager.py NOTE 4). Returns the join, which the runner calls at its next call, before it
        samples the next step (worker/pipelined_step.py NOTE 5); None when the work stays on the engine thread
        (no grammar sampled, or a backend without GIL-free batch calls). The runner's last call on this
        step's masks."""
        ahead, self._ahead = self._ahead, None
        self._fill = _resolved
        return ahead(req_ids, sample_rows, fetch) if ahead is not None else None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_none, ())


def _none() -> None:
    return None


def _resolved(previous: Any) -> GrammarBitmask | None:
    raise RuntimeError("a DeferredBitmask is resolved once, before its accept_ahead")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int], mask_rows: list[int]) -> None:
    """Set to -inf, in place, every logit of `logits[logit_rows[i]]` that row `mask_rows[i]` of `bitmask` forbids.

    On the logits' device, after the model (outside any CUDA graph) and before the sampler; the only host
    work is the index lists. The bits are unpacked with shifts on an accelerator, with numpy on the CPU.
    """
    device = logits.device
    vocab = logits.shape[-1]
    identity = len(mask_rows) == bitmask.shape[0] and mask_rows == list(range(len(mask_rows)))
    if device.type == "cuda" and logits.stride(-1) == 1 and _triton():
        from pagedllm.structured_output.bitmask_triton import apply_bitmask_triton

        # Asynchronous from the pinned mask buffer (manager.py), as below; one kernel masks (bitmask_triton.py).
        mask = bitmask.to(device, non_blocking=True)
        if identity and logit_rows == mask_rows and len(mask_rows) == logits.shape[0]:
            apply_bitmask_triton(logits, mask, None, None)
        else:
            index = to_device([logit_rows, mask_rows], torch.int64, device)
            apply_bitmask_triton(logits, mask, index[0], index[1])
        return
    if device.type == "cpu":
        forbidden = _forbidden_cpu(bitmask if identity else bitmask[mask_rows], vocab)
    else:
        # Both copies are asynchronous (a pinned mask buffer: manager.py; to_device's pinned staging): a
        # synchronous one would make the host wait here for the step's forward to finish.
        mask = bitmask.to(device, non_blocking=True)
        if not identity:
            mask = mask[to_device(mask_rows, torch.int64, device)]
        forbidden = forbidden_by_shifts(mask, vocab)
    if logit_rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = to_device(logit_rows, torch.int64, device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def _triton() -> bool:
    global _TRITON
    if _TRITON is None:
        from pagedllm.layers.fused_ops import triton_available

        _TRITON = triton_available()
    return _TRITON


_TRITON: bool | None = None


def forbidden_by_shifts(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, True = forbidden, with elementwise shifts on `mask`'s device (an accelerator's
    path: no host work). As on the CPU (`_forbidden_cpu`), the words are inverted first (1/32 of the
    elements) and their bytes unpacked by eight shifts into 0/1 bytes read as bools without a copy: shifting
    each int32 word by 32 built a [rows, width, 32] int32 intermediate twice (>>, then & 1) and then compared
    it, ~5x the bytes (at 256 rows of a 128k vocabulary, ~560 MB of device traffic a step against ~110 MB).
    Little-endian words put token 32 w + 8 b + j in bit j of byte b of word w."""
    shifts = _SHIFTS.get(mask.device)
    if shifts is None:
        shifts = _SHIFTS[mask.device] = torch.arange(8, dtype=torch.uint8, device=mask.device)
    words = torch.bitwise_not(mask).view(torch.uint8)
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1)
    return bits.flatten(1)[:, :vocab].view(torch.bool)


def _forbidden_cpu(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, True = forbidden, from the int32 words in one numpy pass: the words are inverted
    (1/32 of the elements), unpacked, and the 0/1 bytes read as bools without a copy; torch's shifts would
    build a [rows, width, 32] int32 intermediate and then invert a full-size mask. Little-endian words put
    tokens 32 w + 8 b + (0..7) in byte b of word w, least significant bit first: bitorder "little"."""
    words = np.invert(bitmask.contiguous().numpy())
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))
