"""Turn one step's schedule (which tokens of which requests) into the flat tensors a model forward takes.

Accounting for request i (nc = num_computed[i], ns = num_scheduled[i], bs = block_size):

    token_ids[i]:  | t0 t1 ... t(nc-1) | t(nc) ... t(nc+ns-1) | t(nc+ns) ...
                   |<- computed: KV  ->|<-  scheduled now  -->|<- known, not scheduled (e.g. rest of a
                   |   already cached  |   rows qsl[i]:qsl[i+1]|   chunked prompt)
    positions:       0 ... nc-1          nc ... nc+ns-1
    seq_lens[i] = nc + ns                (context length after this step)

    flat row t (qsl[i] <= t < qsl[i+1]) is token position p = nc + (t - qsl[i]);
    it is stored at slot  block_ids[i][p // bs] * bs + p % bs,
    e.g. bs=4, block_ids[i]=[7, 2], p=5 -> block 2, offset 1 -> slot 9.

    qsl = query_start_loc = [0, ns_0, ns_0+ns_1, ...] (B+1 entries); logits_indices[i] = qsl[i+1] - 1,
    the last scheduled row of each request (the one whose logits sample the next token).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.protocols.attention import CommonAttentionMetadata


@dataclass
class StepInputs:
    """What the model runner feeds the model for one step (T scheduled tokens over B requests)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: CommonAttentionMetadata
    logits_indices: torch.Tensor  # [B] int64: row of each request's last scheduled token


@dataclass
class HostInputs:
    """One step's inputs as host arrays (numpy), before they go to the device; shapes as in StepInputs."""

    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_table: np.ndarray  # [B, max_blocks] int32, 0-padded
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_decodes: int


def plan_inputs(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_ids: list[list[int]],
    block_size: int,
    num_decodes: int,
) -> HostInputs:
    """Compute input ids, positions, slot mapping, block table and offsets on the host (no torch, no device).

    Requests must be ordered decodes first: the leading `num_decodes` requests schedule exactly one token.
    Raises ValueError when a request's scheduled tokens are not all known or its blocks cannot hold them.
    """
    num_reqs = len(num_scheduled)
    computed = np.asarray(num_computed, dtype=np.int64)
    scheduled = np.asarray(num_scheduled, dtype=np.int64)
    seq_lens = computed + scheduled
    _validate(token_ids, computed, scheduled, seq_lens, block_ids, block_size, num_decodes)

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # Per flat row: its request, then its position within that request's sequence.
    req_of_row = np.repeat(np.arange(num_reqs), scheduled)
    positions = computed[req_of_row] + (np.arange(num_tokens) - query_start_loc[req_of_row])

    # Slicing is per request; the copy of each slice is done in C, not by a per-token Python loop.
    input_ids = np.fromiter(
        itertools.chain.from_iterable(
            t[c : c + s] for t, c, s in zip(token_ids, num_computed, num_scheduled, strict=True)
        ),
        dtype=np.int64,
        count=num_tokens,
    )

    # Block table [B, max_blocks], padded with block 0 (never read: masked by seq_lens).
    blocks_per_req = np.asarray([len(b) for b in block_ids], dtype=np.int64)
    max_blocks = max(1, int(blocks_per_req.max(initial=0)))
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    if blocks_per_req.sum():
        rows = np.repeat(np.arange(num_reqs), blocks_per_req)
        block_starts = np.concatenate(([0], np.cumsum(blocks_per_req)[:-1]))
        cols = np.arange(int(blocks_per_req.sum())) - block_starts[rows]
        block_table[rows, cols] = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int32)

    slot_mapping = block_table[req_of_row, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )
    return HostInputs(
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        logits_indices=query_start_loc[1:] - 1,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=int(scheduled.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        block_size=block_size,
        num_decodes=num_decodes,
    )


def prepare_inputs(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
    num_decodes: int,
) -> StepInputs:
    """`plan_inputs`, then fresh device tensors (the CPU path; the GPU runner copies into persistent buffers).

    Requests must be ordered decodes first: the leading `num_decodes` requests schedule exactly one token.
    Raises ValueError when a request's scheduled tokens are not all known or its blocks cannot hold them.
    """
    host = plan_inputs(token_ids, num_computed, num_scheduled, block_ids, block_size, num_decodes)

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        # From pageable host memory CUDA stages the copy before returning, so the numpy buffers may go away.
        return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

    qsl_cpu = torch.from_numpy(host.query_start_loc)
    seq_lens_cpu = torch.from_numpy(host.seq_lens)
    attn = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        block_table=to_device(host.block_table, torch.int32),
        slot_mapping=to_device(host.slot_mapping, torch.int64),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        num_reqs=host.num_reqs,
        num_actual_tokens=host.num_tokens,
        max_query_len=host.max_query_len,
        max_seq_len=host.max_seq_len,
        block_size=block_size,
        num_decodes=num_decodes,
    )
    return StepInputs(
        input_ids=to_device(host.input_ids, torch.int64),
        positions=to_device(host.positions, torch.int64),
        attn=attn,
        logits_indices=to_device(host.logits_indices, torch.int64),
    )


def _validate(
    token_ids: list[list[int]],
    computed: np.ndarray,
    scheduled: np.ndarray,
    seq_lens: np.ndarray,
    block_ids: list[list[int]],
    block_size: int,
    num_decodes: int,
) -> None:
    num_reqs = len(scheduled)
    if not (len(token_ids) == len(computed) == len(block_ids) == num_reqs):
        raise ValueError(
            "token_ids, num_computed, num_scheduled and block_ids must have one entry per request"
        )
    if num_reqs == 0:
        raise ValueError("a step needs at least one request")
    if (scheduled < 1).any() or (computed < 0).any():
        raise ValueError("every request must schedule at least one token and have num_computed >= 0")
    if not 0 <= num_decodes <= num_reqs or (scheduled[:num_decodes] != 1).any():
        raise ValueError(f"the first num_decodes={num_decodes} requests must schedule exactly one token")
    known = np.asarray([len(t) for t in token_ids], dtype=np.int64)
    short = np.nonzero(seq_lens > known)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"request {i}: scheduled up to token {int(seq_lens[i])} but only {int(known[i])} known"
        )
    capacity = np.asarray([len(b) for b in block_ids], dtype=np.int64) * block_size
    small = np.nonzero(seq_lens > capacity)[0]
    if small.size:
        i = int(small[0])
        raise ValueError(
            f"request {i}: {int(seq_lens[i])} tokens need more than its {len(block_ids[i])} blocks"
        )
