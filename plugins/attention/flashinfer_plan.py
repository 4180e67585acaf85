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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.protocols.attention import CommonAttentionMetadata


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
    seq_lens = common.seq_lens_cpu[:num_reqs].to(torch.int32)
    qsl = common.query_start_loc_cpu[: num_reqs + 1].to(torch.int32)
    pages = (seq_lens + page - 1) // page
    kv_indptr = torch.zeros(num_reqs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * page, 0).to(torch.int32)

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
        return PagedKVPart(
            num_reqs=hi - lo,
            qo_indptr_cpu=(qsl[lo : hi + 1] - qsl[lo]).contiguous(),
            kv_indptr_cpu=(kv_indptr[lo : hi + 1] - first).contiguous(),
            kv_indices=kv_indices[first:last],
            last_page_len_cpu=last_page_len[lo:hi].contiguous(),
            query_start=int(qsl[lo]),
            query_end=int(qsl[hi]),
        )

    return PagedKVPlan(decode=part(0, num_decodes), prefill=part(num_decodes, num_reqs))
