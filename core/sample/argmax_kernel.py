"""Greedy argmax over a large vocabulary in one launch: out[b] = torch.argmax(logits[b]) bit for bit.

torch's argmax of one [1, 128256] row ran as a single-block reduce on the H200: 29 us of a 1 ms Llama-3.2-1B
decode step, for 256 KB of logits. Here the row is cut into chunks that run side by side:

    grid (B, CHUNKS)          program (row b, chunk c of BLOCK logits)
    each program              (value, index) of its chunk's winner -> part_val[b, c], part_idx[b, c]
                              then one ticket on row b (acq_rel, gpu scope)
    the last ticket's program reads row b's CHUNKS winners through L2 (`.cg`), picks the row's winner by the
                              same rule, writes out[b], puts the ticket back to 0 (zero between launches)

NOTE 1 (torch's order): the winner is the lowest index among the maxima, and a NaN beats every number (torch
returns the first NaN). Each stage applies the same rule -- NaNs present: the lowest NaN index; else the
lowest index whose value equals the max -- and a chunk's winner carries its value (NaN stays NaN), so the
second stage sees exactly what the row holds. An all -inf row gives index 0, as torch does.
NOTE 2: values are compared in float32; a bf16 / fp16 logit converts exactly, keeping order and ties.
NOTE 3: the tickets are split_k's per-device buffer, shared with the split-K GEMVs: each launch leaves its
tickets at zero, and the decode runs one launch at a time on one stream.

Imported only when a CUDA greedy argmax runs (it imports triton); greedy_argmax.py holds the rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch
from pagedllm.layers.split_k import tickets

MAX_CHUNKS = 128  # the second stage reads a row's winners in one load of this many


@triton.jit
def _winner(vals, idxs, valid):
    """(value, index) of `vals` by torch's rule (NOTE 1); `idxs` increase along the block."""
    nan = (vals != vals) & valid
    key = tl.where(valid & (vals == vals), vals, float("-inf"))
    top = tl.max(key, axis=0)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    hit = tl.where(any_nan, nan, valid & (key == top))
    idx = tl.min(tl.where(hit, idxs, 2147483647), axis=0)
    return tl.where(any_nan, float("nan"), top), idx


@triton.jit
def _argmax_kernel(logits_ptr, part_val_ptr, part_idx_ptr, ticket_ptr, out_ptr, V, stride_b, CHUNKS,
                   BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    vals = tl.load(logits_ptr + row.to(tl.int64) * stride_b + offs, mask=ok, other=float("-inf"))
    val, idx = _winner(vals.to(tl.float32), offs, ok)  # NOTE 2
    tl.store(part_val_ptr + row * CHUNKS + chunk, val)
    tl.store(part_idx_ptr + row * CHUNKS + chunk, idx)
    tl.debug_barrier()  # the stores before the ticket
    last = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1
    if last:
        c = tl.arange(0, CHUNKS_P2)
        c_ok = c < CHUNKS
        part_vals = tl.load(part_val_ptr + row * CHUNKS + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        part_idxs = tl.load(part_idx_ptr + row * CHUNKS + c, mask=c_ok, other=2147483647, cache_modifier=".cg")
        _, best = _winner(part_vals, part_idxs, c_ok)
        tl.store(out_ptr + row, best.to(tl.int64))
        tl.atomic_xchg(ticket_ptr + row, 0, sem="relaxed", scope="gpu")


def chunk_block(vocab: int) -> int:
    """Logits per program: 2048 (a 16-byte load per thread, 4 warps, twice), more only past MAX_CHUNKS chunks."""
    return max(2048, triton.next_power_of_2(triton.cdiv(vocab, MAX_CHUNKS)))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: the argmax of each row of `logits` [B, V] (last dim contiguous), torch's tie-break."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] > 0, (logits.shape, logits.stride())
    b, v = logits.shape
    block = chunk_block(v)
    chunks = triton.cdiv(v, block)
    part_val = torch.empty(b, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(b, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    launch(_argmax_kernel, (b, chunks), logits, part_val, part_idx, tickets(logits.device, b), out,
           v, logits.stride(0), chunks, BLOCK=block, CHUNKS_P2=triton.next_power_of_2(chunks), num_warps=4)
    return out
