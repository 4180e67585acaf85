"""Split-K in one launch, shared by the decode GEMVs (dense_gemv_kernel.py, the W4A16 tiled GEMV, the GGUF
block GEMV): each program of an n block stores its float32 partials [split, row, n], takes a ticket, and the
program that draws the last ticket sums the partials in a fixed order (the same bits every run), writes y and
puts the ticket back to 0 -- no second kernel per linear, and the ticket buffer stays zero between launches,
so the launches are CUDA-graph safe (dense_gemv_kernel.py NOTE 2).

Imported by those kernel modules only (it imports triton).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

ROWS_MAX = 4  # the row accumulators below are unrolled for this many activation rows


@triton.jit
def store_rows(ptr, stride_m, t0, t1, t2, t3, n_ok, ROWS: tl.constexpr):
    """Rows 0..ROWS-1 of a [ROWS, BLOCK_N] result at ptr (row stride stride_m), cast to ptr's dtype."""
    tl.store(ptr, t0.to(ptr.dtype.element_ty), mask=n_ok)
    if ROWS > 1:
        tl.store(ptr + stride_m, t1.to(ptr.dtype.element_ty), mask=n_ok)
    if ROWS > 2:
        tl.store(ptr + 2 * stride_m, t2.to(ptr.dtype.element_ty), mask=n_ok)
    if ROWS > 3:
        tl.store(ptr + 3 * stride_m, t3.to(ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _chunk_sum(src, m):
    return tl.sum(tl.load(src, mask=m, other=0.0, cache_modifier=".cg"), axis=0)


@triton.jit
def sum_split_partials(part_ptr, offs_n, n_ok, N, MN, SPLITS, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One n block's float32 split-K partials, laid out [split, row, n], summed in a fixed order (the same
    bits every run); read through L2 (`.cg`), where the other programs' stores landed.

    CHUNK splits are one 2-D load per row, so their L2 round trips overlap (a loop of one split per iteration
    waited for each in turn: the chunks took the W4A16 GEMV's 8B layer from 60.7 to 55.5 us on the H200,
    docs/perf-notes.md §12). Within a chunk tl.sum's tree fixes the order, chunks are added in split order.
    """
    CHUNK: tl.constexpr = 16 // ROWS if ROWS < 3 else 4  # [CHUNK, BLOCK_N] per row: <= 16 values a column
    t0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t1, t2, t3 = t0, t0, t0
    for s0 in range(0, SPLITS, CHUNK):
        offs_s = s0 + tl.arange(0, CHUNK)
        src = part_ptr + offs_s[:, None] * MN + offs_n[None, :]
        m = (offs_s < SPLITS)[:, None] & n_ok[None, :]
        t0 += _chunk_sum(src, m)
        if ROWS > 1:
            t1 += _chunk_sum(src + N, m)
        if ROWS > 2:
            t2 += _chunk_sum(src + 2 * N, m)
        if ROWS > 3:
            t3 += _chunk_sum(src + 3 * N, m)
    return t0, t1, t2, t3


@triton.jit
def reduce_split(part_ptr, ticket_ptr, pid_n, pid_k, offs_n, n_ok, N, SPLITS, t0, t1, t2, t3,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's partials [ROWS, BLOCK_N] stored, then its n block's ticket drawn (module docstring).

    Returns (last, sums): the program that draws the last ticket gets the n block's totals, in a fixed order,
    and has already put the ticket back to 0; every other program gets its own partials back and stores
    nothing. The caller writes y when `last` (adding a bias or rounding as its kernel does)."""
    MN = ROWS * N
    store_rows(part_ptr + pid_k * MN + offs_n, N, t0, t1, t2, t3, n_ok, ROWS)
    tl.debug_barrier()  # every thread's stores before the ticket
    last = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        t0, t1, t2, t3 = sum_split_partials(part_ptr, offs_n, n_ok, N, MN, SPLITS, ROWS, BLOCK_N)
        tl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    return last, t0, t1, t2, t3


_TICKETS: dict[torch.device, torch.Tensor] = {}
# Outgrown ticket buffers are kept, never freed: a CUDA graph captured earlier may still point at one.
_RETIRED: list[torch.Tensor] = []


def tickets(device: torch.device, count: int) -> torch.Tensor:
    """The per-device int32 tickets, all zero between launches. One buffer for every GEMV: the engine's decode
    runs one launch at a time on one stream. Allocated at the eager warm-up, before any capture."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < count:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(count, 16384), dtype=torch.int32, device=device)
        _TICKETS[device] = buf
    return buf


class SplitK(NamedTuple):
    """One launch's split of K and its buffers (`part`, `tickets` are `y` itself when split == 1: unread)."""

    per_split: int  # K units (inputs or blocks) per split, a whole number of steps
    split: int  # the split actually run: every split owns at least one step, so every partial is written
    col_blocks: int
    y: torch.Tensor  # [m, n] in x's dtype
    part: torch.Tensor  # [split, m, n] float32 partials
    tickets: torch.Tensor


def split_k(x: torch.Tensor, m: int, n: int, units: int, step: int, split: int, block_n: int) -> SplitK:
    """Cut `units` of K into about `split` slices of whole `step`s, and allocate the launch's output buffers."""
    per_split = triton.cdiv(triton.cdiv(units, split), step) * step
    split = triton.cdiv(units, per_split)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    col_blocks = triton.cdiv(n, block_n)
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    ticket_buf = y if split == 1 else tickets(x.device, col_blocks)
    return SplitK(per_split, split, col_blocks, y, part, ticket_buf)
