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

KV-cache groups (hybrid models, e.g. Gemma's local and global layers): each group has its own block ids per
request and its own block size, so its own block table and slot mapping; everything else (ids, positions,
query_start_loc, seq_lens) is shared. Group 0 is `block_ids` / `block_size`; groups 1.. come in
`more_groups` and travel as `HostInputs.extra_groups` / `StepInputs.extra_groups`. A one-group model pays
nothing for this.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from pagedllm.protocols.attention import CommonAttentionMetadata, KVGroupMetadata

# One extra KV-cache group's input to plan_inputs: (block ids per request, the group's block size).
GroupBlockIds = tuple[list[list[int]], int]


@dataclass
class StepInputs:
    """What the model runner feeds the model for one step (T scheduled tokens over B requests)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: CommonAttentionMetadata  # KV-cache group 0's (the only group of most models)
    logits_indices: torch.Tensor  # [B] int64: row of each request's last scheduled token
    # Groups 1.. of a hybrid model: `attn` with that group's block_table, slot_mapping and block_size.
    extra_groups: list[CommonAttentionMetadata] = field(default_factory=list)

    @property
    def group_attn(self) -> list[CommonAttentionMetadata]:
        """The common metadata of every KV-cache group, indexed by group id."""
        return [self.attn, *self.extra_groups]


@dataclass
class GroupTable:
    """One extra KV-cache group's block table and slot mapping on the host (shapes as in HostInputs)."""

    block_table: np.ndarray
    slot_mapping: np.ndarray
    block_size: int


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
    extra_groups: list[GroupTable] = field(default_factory=list)  # KV-cache groups 1..


class BlockTableCache:
    """One KV-cache group's block table from the last step, updated in place when the next step has the same
    requests in the same order -- the steady decode batch -- so a step costs the rows that gained a block
    (about 1 in block_size per step) instead of a copy of every request's whole block list (20,000 ids per
    step at 500 requests of ~640 tokens, about 1 ms of host time).

    Only for block lists that only ever grow by appending, passed as the same list objects step after step
    (the model runner's request states: `_update_states` only extends them). Rows are matched by the
    identity of those lists, which the cache holds, so a new request's list can never pass for an old one.
    """

    def __init__(self) -> None:
        self._lists: list[list[int]] = []
        self._lens = np.zeros(0, dtype=np.int64)
        self._table = np.zeros((0, 1), dtype=np.int32)

    def table(self, block_ids: list[list[int]]) -> np.ndarray:
        """The [B, max_blocks] int32 block table of `block_ids`, 0-padded (a fresh array the caller may keep)."""
        n = len(block_ids)
        lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=n)
        max_blocks = max(1, int(lens.max(initial=0)))
        table = self._table
        same = (
            len(self._lists) == n
            and all(map(operator.is_, self._lists, block_ids))
            and not (lens < self._lens).any()
        )
        if same:
            if max_blocks > table.shape[1]:  # grow the width with room to spare: this is rare
                grown = np.zeros((n, max_blocks + max_blocks // 4 + 1), dtype=np.int32)
                grown[:, : table.shape[1]] = table
                table = self._table = grown
            old = self._lens
            for i in np.nonzero(lens != old)[0].tolist():
                start = int(old[i])
                table[i, start : int(lens[i])] = block_ids[i][start:]
        else:
            table = self._table = _block_table(block_ids, lens, max_blocks + max_blocks // 4 + 1)
            self._lists = list(block_ids)
        self._lens = lens
        return table[:, :max_blocks].copy()


def plan_inputs(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_ids: list[list[int]],
    block_size: int,
    num_decodes: int,
    more_groups: Sequence[GroupBlockIds] = (),
    table_caches: Sequence[BlockTableCache] | None = None,
) -> HostInputs:
    """Compute input ids, positions, slot mapping, block table and offsets on the host (no torch, no device).

    Requests must be ordered decodes first: the leading `num_decodes` requests schedule exactly one token.
    `more_groups` holds KV-cache groups 1.. of a hybrid model (group 0 is block_ids / block_size).
    `table_caches` (one per group, group 0 first) keep the block tables between steps; see BlockTableCache
    for what the block lists must then guarantee.
    Raises ValueError when a request's scheduled tokens are not all known or its blocks cannot hold them.
    """
    num_reqs = len(num_scheduled)
    if 0 < num_reqs <= SMALL_DECODE_BATCH and num_decodes == num_reqs and not more_groups and (
        len(token_ids) == len(num_computed) == len(block_ids) == num_reqs and all(n == 1 for n in num_scheduled)
    ):
        return _plan_small_decode(token_ids, num_computed, block_ids, block_size, table_caches[0] if table_caches else None)
    computed = np.asarray(num_computed, dtype=np.int64)
    scheduled = np.asarray(num_scheduled, dtype=np.int64)
    seq_lens = computed + scheduled
    _validate(token_ids, computed, scheduled, seq_lens, block_ids, block_size, num_decodes)
    for gid, (group_ids, group_block_size) in enumerate(more_groups, start=1):
        if len(group_ids) != num_reqs:
            raise ValueError(f"KV-cache group {gid}: block ids for {len(group_ids)} of {num_reqs} requests")
        _check_capacity(seq_lens, group_ids, group_block_size, f"KV-cache group {gid}: ")

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # Per flat row: its request, then its position within that request's sequence.
    req_of_row = np.repeat(np.arange(num_reqs), scheduled)
    positions = computed[req_of_row] + (np.arange(num_tokens) - query_start_loc[req_of_row])

    if num_decodes == num_reqs:  # one token per request: index, no slices
        input_ids = np.fromiter(map(operator.getitem, token_ids, num_computed), dtype=np.int64, count=num_reqs)
    else:
        # Slicing is per request; the copy of each slice is done in C, not by a per-token Python loop.
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                t[c : c + s] for t, c, s in zip(token_ids, num_computed, num_scheduled, strict=True)
            ),
            dtype=np.int64,
            count=num_tokens,
        )

    caches: Sequence[BlockTableCache | None] = table_caches or [None] * (1 + len(more_groups))
    block_table, slot_mapping = _table_and_slots(block_ids, block_size, req_of_row, positions, caches[0])
    extra = [
        GroupTable(*_table_and_slots(ids, size, req_of_row, positions, cache), size)
        for (ids, size), cache in zip(more_groups, caches[1:], strict=True)
    ]
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
        extra_groups=extra,
    )


# NOTE: up to this many one-token requests (single-stream decode, the CPU's usual step), `plan_inputs` computes
# with plain ints: its numpy route makes ~25 calls on arrays of one element, ~50 us a step warm and ~250 us in
# the engine (where each token's weights have pushed everything else out of the CPU caches).
SMALL_DECODE_BATCH = 8


def _plan_small_decode(
    token_ids: list[list[int]],
    num_computed: list[int],
    block_ids: list[list[int]],
    block_size: int,
    cache: BlockTableCache | None,
) -> HostInputs:
    """`plan_inputs` of one token per request, as plain ints: the same arrays, the same errors (in _validate's
    order: a negative count, then the first request short of tokens, then the first short of blocks)."""
    num_reqs = len(num_computed)
    if any(c < 0 for c in num_computed):
        raise ValueError("every request must schedule at least one token and have num_computed >= 0")
    seq_lens = [c + 1 for c in num_computed]
    for i, (tokens, n) in enumerate(zip(token_ids, seq_lens)):
        if n > len(tokens):
            raise ValueError(f"request {i}: scheduled up to token {n} but only {len(tokens)} known")
    for i, (ids, n) in enumerate(zip(block_ids, seq_lens)):
        if n > len(ids) * block_size:
            raise ValueError(f"request {i}: {n} tokens need more than its {len(ids)} blocks")
    if cache is not None:
        block_table = cache.table(block_ids)
    else:
        lens = np.asarray([len(b) for b in block_ids], dtype=np.int64)
        block_table = _block_table(block_ids, lens, max(1, int(lens.max(initial=0))))
    return HostInputs(
        input_ids=np.array([t[c] for t, c in zip(token_ids, num_computed)], dtype=np.int64),
        positions=np.array(num_computed, dtype=np.int64),
        query_start_loc=np.arange(num_reqs + 1, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_table=block_table,
        slot_mapping=np.array([ids[c // block_size] * block_size + c % block_size
                               for ids, c in zip(block_ids, num_computed)], dtype=np.int64),
        logits_indices=np.arange(num_reqs, dtype=np.int64),
        num_reqs=num_reqs,
        num_tokens=num_reqs,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_decodes=num_reqs,
    )


def _block_table(block_ids: list[list[int]], blocks_per_req: np.ndarray, width: int) -> np.ndarray:
    """[B, width] int32: row i holds block_ids[i] then 0s (block 0 pads: never read, masked by seq_lens)."""
    num_reqs = len(block_ids)
    block_table = np.zeros((num_reqs, width), dtype=np.int32)
    if blocks_per_req.sum():
        rows = np.repeat(np.arange(num_reqs), blocks_per_req)
        block_starts = np.concatenate(([0], np.cumsum(blocks_per_req)[:-1]))
        cols = np.arange(int(blocks_per_req.sum())) - block_starts[rows]
        block_table[rows, cols] = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int32)
    return block_table


def _table_and_slots(
    block_ids: list[list[int]],
    block_size: int,
    req_of_row: np.ndarray,
    positions: np.ndarray,
    cache: BlockTableCache | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One group's block table [B, max_blocks] (0-padded) and slot mapping [T]."""
    if cache is not None:
        block_table = cache.table(block_ids)
    else:
        blocks_per_req = np.asarray([len(b) for b in block_ids], dtype=np.int64)
        block_table = _block_table(block_ids, blocks_per_req, max(1, int(blocks_per_req.max(initial=0))))
    slot_mapping = block_table[req_of_row, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )
    return block_table, slot_mapping


def prepare_inputs(
    token_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
    num_decodes: int,
    more_groups: Sequence[GroupBlockIds] = (),
    table_caches: Sequence[BlockTableCache] | None = None,
) -> StepInputs:
    """`plan_inputs`, then fresh device tensors (the CPU path; the GPU runner copies into persistent buffers).

    Requests must be ordered decodes first: the leading `num_decodes` requests schedule exactly one token.
    Raises ValueError when a request's scheduled tokens are not all known or its blocks cannot hold them.
    """
    host = plan_inputs(
        token_ids, num_computed, num_scheduled, block_ids, block_size, num_decodes, more_groups, table_caches
    )

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
    extra = [
        replace(
            attn,
            block_table=to_device(g.block_table, torch.int32),
            slot_mapping=to_device(g.slot_mapping, torch.int64),
            block_size=g.block_size,
        )
        for g in host.extra_groups
    ]
    return StepInputs(
        input_ids=to_device(host.input_ids, torch.int64),
        positions=to_device(host.positions, torch.int64),
        attn=attn,
        logits_indices=to_device(host.logits_indices, torch.int64),
        extra_groups=extra,
    )


def build_attn_metadata(backend: Any, inputs: StepInputs) -> Any:
    """The backend's metadata for the step: one object, or a KVGroupMetadata with one per KV-cache group."""
    if not inputs.extra_groups:
        return backend.build_metadata(inputs.attn)
    return KVGroupMetadata([backend.build_metadata(common) for common in inputs.group_attn])


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
    _check_capacity(seq_lens, block_ids, block_size)


def _check_capacity(
    seq_lens: np.ndarray, block_ids: list[list[int]], block_size: int, where: str = ""
) -> None:
    capacity = np.asarray([len(b) for b in block_ids], dtype=np.int64) * block_size
    small = np.nonzero(seq_lens > capacity)[0]
    if small.size:
        i = int(small[0])
        raise ValueError(
            f"{where}request {i}: {int(seq_lens[i])} tokens need more than its {len(block_ids[i])} blocks"
        )
