"""FlashInfer's paged-KV description of one step, built from the common metadata (plain torch, no flashinfer).

FlashInfer addresses a batch's pages through CSR arrays instead of a padded block table:

    request i's pages:      kv_indices[kv_indptr[i] : kv_indptr[i+1]]      (block ids, in order)
    its tokens:             (pages - 1) * page_size + kv_last_page_len[i]   (1 <= last_page_len <= page_size)
    its query rows:         qo_indptr[i] : qo_indptr[i+1]                  (prefill wrapper only)

The runner orders decodes first, so the batch splits into a decode part (requests 0 .. D-1, one query each)
and a prefill part (D .. B-1); each part is rebased to start at 0 for its own wrapper.

Host vs device (NOTE 1): FlashInfer's plan() copies the indptr and last-page arrays to the host to schedule
its work, so they are built on the host from `seq_lens_cpu` / `query_start_loc_cpu` (no device->host sync).
The page ids live in the device block table; they are gathered on the device into kv_indices with sizes known
on the host (repeat_interleave with output_size), again without a sync:

    pages      = ceil(seq_len / page_size)                     per request, host
    kv_indptr  = [0, cumsum(pages)]                            host
    row[j]     = the request owning flat page slot j           device, repeat_interleave(arange(B), pages)
    col[j]     = j - kv_indptr[row[j]]                         device
    kv_indices = block_table[row, col]                         device

On a CUDA device the host arrays are pinned, so every host->device copy of them (ours, and plan()'s) is truly
asynchronous; the caching host allocator keeps a pinned block from reuse until the copies reading it have run.

CUDA-graph decode (NOTE 2). A captured decode kernel reads the page CSR from fixed device buffers, one set per
graph (`GraphDecodeBuffers`: batch size P, P x max_blocks page slots), which FlashInfer's graph-mode plan()
rewrites before each replay. The runner pads a decode step to P requests whose padding rows are 1-token
requests on the null block (seq_len 1, block table row [0, ...]), so the same construction gives them one page
(id 0) and last_page_len 1 -- a valid, harmless request whose output row nobody reads (vLLM pads with 0 pages
and last_page_len 1 instead; a real page keeps every request's kv length >= 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.api.attention import CommonAttentionMetadata


@dataclass
class PagedKVPart:
    """One wrapper's share of the batch (all indices rebased to this part)."""

    num_reqs: int
    qo_indptr_cpu: torch.Tensor  # [n + 1] int32, host: query rows of each request
    kv_indptr_cpu: torch.Tensor  # [n + 1] int32, host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, device
    last_page_len_cpu: torch.Tensor  # [n] int32, host
    query_start: int  # first flat query row of the part
    query_end: int


@dataclass
class PagedKVPlan:
    decode: PagedKVPart | None
    prefill: PagedKVPart | None


def paged_kv_plan(common: CommonAttentionMetadata) -> PagedKVPlan:
    """Split the step into its decode and prefill parts and describe each in FlashInfer's CSR form."""
    num_reqs, page = common.num_reqs, common.block_size
    device = common.block_table.device
    pin = device.type == "cuda"

    def host(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, pin_memory=pin)

    seq_lens = common.seq_lens_cpu[:num_reqs].to(torch.int32)
    qsl = common.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
    pages = torch.floor_divide(seq_lens + (page - 1), page, out=host(num_reqs))
    kv_indptr = host(num_reqs + 1)
    kv_indptr[0] = 0
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    last_page_len = torch.sub(seq_lens, (pages - 1) * page, out=host(num_reqs)).masked_fill_(pages == 0, 0)

    total = int(kv_indptr[-1])
    rows = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), pages.to(device, non_blocking=True), output_size=total
    )
    cols = torch.arange(total, device=device) - kv_indptr.to(device, non_blocking=True)[rows]
    kv_indices = common.block_table[rows, cols].to(torch.int32)

    num_decodes = common.num_decodes
    if int(qsl[num_decodes]) != num_decodes:
        raise ValueError(f"the first {num_decodes} requests must be decodes with exactly one query token")

    def part(lo: int, hi: int) -> PagedKVPart | None:
        if hi <= lo:
            return None
        first, last = int(kv_indptr[lo]), int(kv_indptr[hi])
        # The decode part starts at 0: views, so the pinned arrays reach plan() as they are.
        kv_part = kv_indptr[lo : hi + 1] if first == 0 else kv_indptr[lo : hi + 1] - first
        return PagedKVPart(
            num_reqs=hi - lo,
            qo_indptr_cpu=(qsl[lo : hi + 1] - qsl[lo]).contiguous(),
            kv_indptr_cpu=kv_part.contiguous(),
            kv_indices=kv_indices[first:last],
            last_page_len_cpu=last_page_len[lo:hi].contiguous(),
            query_start=int(qsl[lo]),
            query_end=int(qsl[hi]),
        )

    return PagedKVPlan(decode=part(0, num_decodes), prefill=part(num_decodes, num_reqs))


@dataclass
class GraphDecodeBuffers:
    """The fixed device buffers one decode CUDA graph's kernels read its page CSR from (NOTE 2)."""

    size: int  # the graph's (padded) batch size P
    kv_indptr: torch.Tensor  # [P + 1] int32
    kv_indices: torch.Tensor  # [P * max_pages] int32: every request may hold max_pages pages
    last_page_len: torch.Tensor  # [P] int32

    @classmethod
    def allocate(cls, size: int, max_pages: int, device: torch.device) -> GraphDecodeBuffers:
        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(size, buf(size + 1), buf(size * max_pages), buf(size))


def graph_decode_part(common: CommonAttentionMetadata, buffers: GraphDecodeBuffers) -> PagedKVPart:
    """The decode CSR of a padded decode-only step for the graph owning `buffers` (NOTE 2); raises if the step
    is not one such a graph can replay (then the runner's padding contract was broken, not the step)."""
    plan = paged_kv_plan(common)
    part = plan.decode
    if plan.prefill is not None or part is None or part.num_reqs != buffers.size:
        raise ValueError(f"a decode graph of {buffers.size} requests got {common.num_reqs} requests of which "
                         f"{common.num_decodes} decodes")
    if part.kv_indices.numel() > buffers.kv_indices.numel():
        raise ValueError(f"{part.kv_indices.numel()} pages exceed the graph's {buffers.kv_indices.numel()} slots")
    return part
