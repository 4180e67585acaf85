"""The GPU fast path of the model runner: persistent step buffers and CUDA graphs of decode steps.

Step buffers (NOTE 1). Every step's inputs are written into the same device tensors, sized once for the
largest step: the host fills pinned mirrors, then one non-blocking copy per tensor moves the used prefix.
A CUDA graph replays fixed addresses, so these buffers are also the graphs' inputs.
Before the host rewrites the pinned mirrors it waits on an event recorded after the previous step's copies:
a step that samples nothing (a non-final prefill chunk) ends without a sync, and the DMA of its inputs may
still be queued behind the step before it.

Decode graphs (NOTE 2). A decode-only step of B requests is padded to the next captured size P of a ladder
(graph_ladder: 1, 2, 4, 8, 16, ..., 64, 96, ... up to max_num_seqs) and replays the graph captured for P. The P - B padding
rows are harmless by construction:

    padding row r:  input id 0, position 0, its own request with query_start_loc r..r+1, seq_len 1,
                    block table row [0, ...] (the null block) and slot_mapping 0 (slot 0 of the null block)

so each writes garbage K/V into the null block -- which no real request reads, block 0 is never allocated
-- and attends over that one slot: finite values in rows nobody samples. A hybrid model's extra KV-cache
groups get the same padding in their own block tables and slot mappings. Only backends that declare
`supports_cuda_graphs` are captured; others run eagerly. A backend whose kernels read host-planned state
re-plans it before each replay (NOTE 6).

Uniform multi-token steps (NOTE 3). Speculative decoding verifies k drafts per request: every request of such
a step schedules q = k + 1 tokens. Those steps get graphs of their own, keyed by (padded size, q), captured
when the engine speculates (`GPURunnerOptions.uniform_query_lens`). Padding request r then holds q tokens at
positions 0..q-1 written to slots 0..q-1 of the null block (q <= block_size), so it attends only over slots
written in the same step. The attention metadata captured for q > 1 is the backend's non-decode one (one
segment), which is right for any batch of that shape; a step with mixed query lengths runs eagerly.

Cascade (NOTE 4). Decode-only steps of >= CASCADE_MIN_REQS requests also carry `cascade` = [P, s, flags]: the
flagged requests' first P tokens are in the same blocks (prefix caching shares them by block id), those of
request s -- the requests whose first block is the step's most common one, found on the host from the block
table each step, so a few requests without the shared system prompt do not switch the cascade off. Graphs of those sizes are captured with it (P = 0 in the dummy step), so a
backend that reads it (triton/backend.py NOTE 3) can read the shared keys once per step inside a replay.

Graph memory: all sizes share one memory pool, captured largest first so smaller graphs reuse its blocks.

Release before leaving a group (NOTE 5). A graph captured with tensor parallelism holds NCCL's all-reduces;
since NCCL 2.26 destroying a communicator waits until every graph that references it is destroyed (the
"keep polling until all graphs referencing us die" loop of commDestroySync). An engine that left its group
with its graphs alive hung there on every rank; with a timeout around the teardown, the process later
aborted at exit ("terminate called without an active exception"). `release` destroys them first.

Per-replay planning (NOTE 6). Some kernels read a work schedule the host computes from the step's lengths
(FlashInfer's plan(): page-table CSR and split-KV tiles, written into fixed buffers the captured kernels read).
Such a backend declares `build_graph_metadata` / `prepare_graph_replay` (protocols.attention
.CUDAGraphAttentionBackend): each graph is captured with the metadata build_graph_metadata made for the padded
dummy step and keeps it; `run` calls prepare_graph_replay(that metadata, the step's padded common metadata)
after loading the buffers and before the replay, so its copies are stream-ordered ahead of the kernels. The
hook is host work plus non-blocking copies; padding requests plan as the 1-token null-block decodes of NOTE 2.
Backends without the hook replay exactly as before. `cuda_graph_max_query_len` (1 for such a backend whose
multi-token plan is not graph-safe) keeps NOTE 3's q > 1 graphs away from it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pagedllm.protocols.attention import CommonAttentionMetadata, KVGroupMetadata
from pagedllm.worker.input_prep import GroupTable, HostInputs, StepInputs, build_attn_metadata

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class GPURunnerOptions:
    """What the GPU path needs to size its buffers and graphs (from EngineConfig, via the builder)."""

    max_num_seqs: int = 256
    max_num_tokens: int = 8192
    max_model_len: int = 8192
    cuda_graphs: bool = True  # the builder calls ModelRunner.capture_cuda_graphs() when set (enforce_eager off)
    graph_batch_sizes: tuple[int, ...] | None = None  # None: graph_ladder(max_num_seqs)
    # Query lengths > 1 whose uniform steps also get graphs (NOTE 3): k + 1 when speculating k drafts.
    uniform_query_lens: tuple[int, ...] = ()


def graph_ladder(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, then every 8 up to 64, then every 32 up to max_num_seqs.

    Fewer sizes capture faster (start-up); coarser steps waste padded rows, which cost little at large
    batches where a decode step streams the weights once whatever the row count.
    """
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, min(64, max_num_seqs) + 1, 8))
    sizes += list(range(96, max_num_seqs + 1, 32))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size holding num_reqs, or None when the batch is larger than every graph."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


# NOTE 4 thresholds: decode steps of at least CASCADE_MIN_REQS (padded) requests carry the cascade tensor, so
# their graphs include the cascade kernels; at run time a shared prefix shorter than CASCADE_MIN_TOKENS is
# reported as 0 (a plain step), as vLLM's heuristic skips short common prefixes.
CASCADE_MIN_REQS = 8
CASCADE_MIN_TOKENS = 256


def uses_cascade(host: HostInputs, reqs: int, query_len: int) -> bool:
    """Whether this step's metadata carries the shared-prefix tensor: decode-only and at least 8 requests."""
    return query_len == 1 and host.num_decodes == host.num_reqs and reqs >= CASCADE_MIN_REQS


def shared_prefix(host: HostInputs) -> tuple[int, int, np.ndarray]:
    """(P, s, flags): the most common first block's requests (flags[i] = 1) hold their first P tokens in the
    same blocks, those of request s; P = 0 below CASCADE_MIN_TOKENS or with fewer than two such requests.

    Only whole blocks before each request's last token count: a block still being written is never shared.
    """
    n, bs = host.num_reqs, host.block_size
    flags = np.zeros(n, dtype=np.int32)
    if n < 2 or host.block_table.shape[1] == 0:
        return 0, 0, flags
    first = host.block_table[:n, 0]
    ids, counts = np.unique(first, return_counts=True)
    members = np.flatnonzero(first == ids[np.argmax(counts)])
    limit = int(host.seq_lens[members].min() - 1) // bs
    if len(members) < 2 or limit * bs < CASCADE_MIN_TOKENS:
        return 0, 0, flags
    table = host.block_table[members, :limit]
    same = (table == table[0]).all(axis=0)
    tokens = (int(np.argmin(same)) if not same.all() else limit) * bs
    if tokens < CASCADE_MIN_TOKENS:
        return 0, 0, flags
    flags[members] = 1
    return tokens, int(members[0]), flags


class StepBuffers:
    """Persistent device tensors for one step's inputs, with pinned host mirrors (NOTE 1).

    One block table and slot mapping per KV-cache group (`num_groups`); `block_table` / `slot_mapping` are
    group 0's.
    """

    def __init__(
        self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device, num_groups: int = 1
    ) -> None:
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        self.device = device
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.input_ids, self.input_ids_h = pair((max_tokens,), torch.int64)
        self.positions, self.positions_h = pair((max_tokens,), torch.int64)
        self.query_start_loc, self.query_start_loc_h = pair((max_reqs + 1,), torch.int32)
        self.seq_lens, self.seq_lens_h = pair((max_reqs,), torch.int32)
        # Per KV-cache group: (device, pinned host) pairs.
        self.slot_mappings = [pair((max_tokens,), torch.int64) for _ in range(num_groups)]
        self.block_tables = [pair((max_reqs, max_blocks), torch.int32) for _ in range(num_groups)]
        self.slot_mapping, self.slot_mapping_h = self.slot_mappings[0]
        self.block_table, self.block_table_h = self.block_tables[0]
        self.logits_indices, self.logits_indices_h = pair((max_reqs,), torch.int64)
        self.cascade, self.cascade_h = pair((2 + max_reqs,), torch.int32)  # NOTE 4: [P, s, flag per request]
        self._copied = torch.cuda.Event() if pin else None  # the last load()'s copies have read the mirrors

    def fits(self, host: HostInputs, pad_to: int | None = None, query_len: int = 1) -> bool:
        reqs = pad_to or host.num_reqs
        tokens = host.num_tokens + (reqs - host.num_reqs) * query_len
        width = max([host.block_table.shape[1], *(g.block_table.shape[1] for g in host.extra_groups)])
        return tokens <= self.max_tokens and reqs <= self.max_reqs and width <= self.max_blocks

    def load(
        self,
        host: HostInputs,
        pad_to: int | None = None,
        query_len: int = 1,
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> StepInputs:
        """Copy `host` into the buffers (padded to `pad_to` requests of `query_len` tokens each, NOTES 2 and 3)
        and return views of them."""
        n, t = host.num_reqs, host.num_tokens
        reqs = pad_to or n
        q = query_len
        tokens = t + (reqs - n) * q  # each padding request is q tokens at positions 0..q-1
        pad = reqs - n
        if self._copied is not None:
            self._copied.synchronize()
        np_ids = self.input_ids_h.numpy()
        np_pos = self.positions_h.numpy()
        np_qsl = self.query_start_loc_h.numpy()
        np_lens = self.seq_lens_h.numpy()
        np_logits = self.logits_indices_h.numpy()
        np_ids[:t] = host.input_ids
        np_pos[:t] = host.positions
        np_qsl[: n + 1] = host.query_start_loc
        np_lens[:n] = host.seq_lens
        np_logits[:n] = host.logits_indices
        pad_slots = np.tile(np.arange(q, dtype=np.int64), pad) if pad else None
        if pad:
            np_ids[t:tokens] = 0
            np_pos[t:tokens] = pad_slots
            np_qsl[n + 1 : reqs + 1] = np.arange(t + q, tokens + 1, q)
            np_lens[n:reqs] = q
            np_logits[n:reqs] = np.arange(t + q - 1, tokens, q)
        self._copy(self.input_ids, self.input_ids_h, tokens)
        if fill is not None:  # placeholders of a pipelined step, filled from the device (model_runner NOTE 1)
            fill(self.input_ids)
        self._copy(self.positions, self.positions_h, tokens)
        self._copy(self.query_start_loc, self.query_start_loc_h, reqs + 1)
        self._copy(self.seq_lens, self.seq_lens_h, reqs)
        self._copy(self.logits_indices, self.logits_indices_h, reqs)
        if uses_cascade(host, reqs, q):
            np_cascade = self.cascade_h.numpy()
            np_cascade[0], np_cascade[1], np_cascade[2 : 2 + n] = shared_prefix(host)
            np_cascade[2 + n : 2 + reqs] = 0  # padding requests share nothing
            self._copy(self.cascade, self.cascade_h, 2 + reqs)
        tables = [(host.block_table, host.slot_mapping)]
        tables += [(g.block_table, g.slot_mapping) for g in host.extra_groups]
        # strict: a step with another number of KV-cache groups than the buffers is a bug, not padding.
        groups = zip(tables, self.block_tables, self.slot_mappings, strict=True)
        for (table, slots), (bt, bt_h), (sm, sm_h) in groups:
            width = table.shape[1]
            np_bt, np_slots = bt_h.numpy(), sm_h.numpy()
            np_bt[:n, :width] = table
            np_slots[:t] = slots
            if pad:
                np_slots[t:tokens] = pad_slots  # slots 0..q-1 of the null block: scratch no request reads
                np_bt[n:reqs, 0] = 0
            # Graph replays read the full-width block table view; stale columns past `width` are never read
            # (keys stop at seq_len), so only the used columns are copied.
            self._copy(sm, sm_h, tokens)
            bt[:reqs, :width].copy_(bt_h[:reqs, :width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views(host, reqs, tokens, q)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
        dst[:n].copy_(src[:n], non_blocking=True)

    def views(self, host: HostInputs, reqs: int, tokens: int, query_len: int = 1) -> StepInputs:
        """StepInputs over the first reqs/tokens of the buffers (the block table at full width); padding
        requests of query_len 1 count as decodes."""
        attn = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: reqs + 1],
            seq_lens=self.seq_lens[:reqs],
            block_table=self.block_table[:reqs],
            slot_mapping=self.slot_mapping[:tokens],
            # The host copies are views of the pinned mirrors: valid until the next step's load().
            query_start_loc_cpu=self.query_start_loc_h[: reqs + 1],
            seq_lens_cpu=self.seq_lens_h[:reqs],
            num_reqs=reqs,
            num_actual_tokens=tokens,
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
            block_size=host.block_size,
            num_decodes=host.num_decodes + (reqs - host.num_reqs if query_len == 1 else 0),
            cascade=self.cascade if uses_cascade(host, reqs, query_len) else None,
        )
        extra = [  # (the cascade's blocks are group 0's)
            replace(attn, block_table=bt[:reqs], slot_mapping=sm[:tokens], block_size=g.block_size, cascade=None)
            for g, (bt, _), (sm, _) in zip(
                host.extra_groups, self.block_tables[1:], self.slot_mappings[1:], strict=True
            )
        ]
        return StepInputs(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            attn=attn,
            logits_indices=self.logits_indices[:reqs],
            extra_groups=extra,
        )


class DecodeGraphs:
    """CUDA graphs of the model forward for decode-only batches, one per padded size (NOTE 2), and for uniform
    steps of q > 1 tokens per request, one per (padded size, q) (NOTE 3)."""

    def __init__(self, model: Any, backend: Any, kv_caches: list[torch.Tensor], buffers: StepBuffers) -> None:
        self.model, self.backend, self.kv_caches, self.buffers = model, backend, kv_caches, buffers
        self.sizes: list[int] = []  # decode (q = 1) sizes
        self.sizes_by_query_len: dict[int, list[int]] = {}
        # (size, q) -> (graph, its output, the attention metadata it was captured with: NOTE 6 re-plans it)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}
        self._pool: Any = None
        self._build_graph_metadata: Any = getattr(backend, "build_graph_metadata", None)
        self._prepare_replay: Any = getattr(backend, "prepare_graph_replay", None)

    def capture(self, sizes: list[int], block_sizes: list[int], query_lens: tuple[int, ...] = ()) -> None:
        """Warm up and capture each size, largest first, in one shared pool (`block_sizes`: one per group);
        then the same for each q in `query_lens` (sizes whose q-token steps fit the buffers)."""
        self._pool = torch.cuda.graph_pool_handle()
        plan = self._plan(sizes, block_sizes, query_lens)
        for q, fitting in plan.items():
            for size in fitting:
                inputs, metadata = self._dummy_step(size, q, block_sizes)
                # Warm-up outside the graph: Triton compiles, cuBLAS picks kernels, lazy buffers get allocated.
                self.model(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    hidden = self.model(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
                self._graphs[(size, q)] = (graph, hidden, metadata)
        self.sizes_by_query_len = {q: sorted(fitting) for q, fitting in plan.items()}
        torch.cuda.synchronize()
        self.sizes = self.sizes_by_query_len[1]
        logger.info("captured CUDA graphs for batch sizes (query length: sizes) %s", self.sizes_by_query_len)

    def compile_ahead(self, sizes: list[int], block_sizes: list[int], query_lens: tuple[int, ...] = ()) -> int:
        """The eager step of each graph capture() would take, nothing captured: inside
        layers/compile_ahead.compiling_ahead() its Triton launches only compile (model_runner NOTE 4).
        Returns the steps run."""
        plan = self._plan(sizes, block_sizes, query_lens)
        for q, fitting in plan.items():
            for size in fitting:
                inputs, metadata = self._dummy_step(size, q, block_sizes)
                self.model(inputs.input_ids, inputs.positions, metadata, self.kv_caches)
        return sum(len(fitting) for fitting in plan.values())

    def _plan(self, sizes: list[int], block_sizes: list[int], query_lens: tuple[int, ...]) -> dict[int, list[int]]:
        """Query length -> the sizes captured for it, largest first (capture order): q = 1, then each q of
        `query_lens` within the block size and the backend's bound (padding requests stay within the null
        block), each with the sizes whose steps fit the buffers."""
        max_q = min(min(block_sizes), getattr(self.backend, "cuda_graph_max_query_len", min(block_sizes)))
        lens = [1] + sorted({q for q in query_lens if 1 < q <= max_q})
        buffers = self.buffers
        return {q: sorted((s for s in sizes if s <= buffers.max_reqs and s * q <= buffers.max_tokens), reverse=True)
                for q in lens}

    def _dummy_step(self, size: int, q: int, block_sizes: list[int]) -> tuple[StepInputs, Any]:
        """A graph's dummy inputs, loaded into the buffers, and the attention metadata it is captured with."""
        inputs = self.buffers.load(_dummy_uniform(size, q, block_sizes), query_len=q)
        return inputs, self._capture_metadata(inputs)

    def release(self) -> None:
        """Destroy every captured graph and drop the pool (NOTE 5); the object is empty afterwards."""
        if self._graphs:
            torch.cuda.synchronize()  # no replay still running
        for graph, _, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self.sizes, self.sizes_by_query_len, self._pool = [], {}, None

    def run(
        self, host: HostInputs, fill: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[StepInputs, torch.Tensor] | None:
        """Replay the graph for this decode-only or uniform step (padded), or None when no graph fits it."""
        if host.num_decodes == host.num_reqs:
            q = 1
        elif host.num_tokens == host.num_reqs * host.max_query_len:
            q = host.max_query_len
        else:
            return None
        size = padded_size(self.sizes_by_query_len.get(q, []), host.num_reqs)
        if size is None or not self.buffers.fits(host, size, q):
            return None
        inputs = self.buffers.load(host, pad_to=size, query_len=q, fill=fill)
        graph, hidden, metadata = self._graphs[(size, q)]
        if self._prepare_replay is not None:  # NOTE 6: host-side re-plan, copies queued ahead of the replay
            if isinstance(metadata, KVGroupMetadata):
                for group_metadata, common in zip(metadata.groups, inputs.group_attn, strict=True):
                    self._prepare_replay(group_metadata, common)
            else:
                self._prepare_replay(metadata, inputs.attn)
        graph.replay()
        return inputs, hidden

    def _capture_metadata(self, inputs: StepInputs) -> Any:
        """The attention metadata a graph is captured with: the backend's graph metadata (NOTE 6), else the
        ordinary per-step metadata."""
        build = self._build_graph_metadata
        if build is None:
            return build_attn_metadata(self.backend, inputs)
        if not inputs.extra_groups:
            return build(inputs.attn)
        return KVGroupMetadata([build(common) for common in inputs.group_attn])


def _dummy_uniform(num_reqs: int, q: int, block_sizes: list[int]) -> HostInputs:
    """num_reqs requests of q tokens each on the null block (what padding requests look like, NOTES 2, 3)."""
    tokens = num_reqs * q
    zeros = np.zeros(tokens, dtype=np.int64)
    slots = np.tile(np.arange(q, dtype=np.int64), num_reqs)
    null_table = np.zeros((num_reqs, 1), dtype=np.int32)
    return HostInputs(
        input_ids=zeros,
        positions=slots,
        query_start_loc=np.arange(0, tokens + 1, q, dtype=np.int32),
        seq_lens=np.full(num_reqs, q, dtype=np.int32),
        block_table=null_table,
        slot_mapping=slots,
        logits_indices=np.arange(q - 1, tokens, q, dtype=np.int64),
        num_reqs=num_reqs,
        num_tokens=tokens,
        max_query_len=q,
        max_seq_len=q,
        block_size=block_sizes[0],
        num_decodes=num_reqs if q == 1 else 0,
        extra_groups=[GroupTable(null_table, slots, size) for size in block_sizes[1:]],
    )
