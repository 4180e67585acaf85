"""The paged block mask: which cache slots each query row of a step may see, as flex_attention's BlockMask.

flex_attention sees one flat key sequence: the KV pages laid end to end, page p holding key rows
p * block_size .. p * block_size + block_size - 1. Two page spaces (PagedMask.pages):

    physical  pages = every block of the cache, in id order (the cache viewed flat, no copy; compiled runs)
    compact   pages = the blocks this step's requests use, ascending ids (gathered; eager runs, whose unfused
              kernel scores every key row, so the key sequence must stay as short as the step)

The step's queries are packed: row t belongs to request r = q_req[t] and sits at position q_pos[t]
(= seq_len[r] - query_len[r] + (t - query_start[r])). A key row k maps back to its request's logical
position through page_to_logical, the inverse of the block tables:

    page = k // block_size     logical block j = page_to_logical[r, page]  (-1: not r's page)
    pos  = j * block_size + k % block_size

    visible(t, k)  =  j >= 0  and  pos <= q_pos[t]                   causal (pos < seq_len follows)
                      and pos > q_pos[t] - W                         sliding window W
                      and pos // C == q_pos[t] // C                  chunked local attention, chunks of C

The BlockMask (BLOCK_SIZE = (q_block_size, block_size): one KV block per page) lists per group of
q_block_size query rows the pages any of them may see, so the kernel skips the rest of the cache; the mask
mod above then decides per element. Block 0 is the null block (it stands in for pages a sliding window
dropped): never a real page of any request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepLayout:
    """Per step, shared by every layer: where each packed query row sits, and each request's pages."""

    q_req: torch.Tensor  # [T] int64: request of query row t
    q_pos: torch.Tensor  # [T] int64: its position in the request
    blocks: torch.Tensor  # [B, max_blocks] int64: physical block of logical block j, -1 past the context
    block_size: int


@dataclass(frozen=True)
class PagedMask:
    """One layer kind's mask for one step: the page space it indexes and the BlockMask over it."""

    pages: torch.Tensor | None  # [P] int64 block ids of the compact space; None: the physical space
    block_mask: BlockMask


def step_layout(
    query_start: list[int], seq_lens: list[int], block_table: torch.Tensor, block_size: int
) -> StepLayout:
    """q_req / q_pos from the host copies (no device sync) and the block table cut to each context."""
    device = block_table.device
    num_reqs = len(seq_lens)
    counts = [query_start[i + 1] - query_start[i] for i in range(num_reqs)]
    q_req = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(counts, dtype=torch.int64))
    first = torch.tensor([s - n for s, n in zip(seq_lens, counts, strict=True)], dtype=torch.int64)
    offsets = torch.arange(len(q_req)) - torch.tensor(query_start[:num_reqs], dtype=torch.int64)[q_req]
    q_pos = first[q_req] + offsets
    max_blocks = -(-max(seq_lens, default=0) // block_size)
    used = torch.arange(max_blocks)[None, :] < torch.tensor([-(-s // block_size) for s in seq_lens])[:, None]
    blocks = torch.where(used.to(device), block_table[:, :max_blocks].long(), -1)
    return StepLayout(q_req.to(device), q_pos.to(device), blocks, block_size)


def visible_range(layout: StepLayout, window: int | None, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the first and last key position it may see (inclusive)."""
    lo = torch.zeros_like(layout.q_pos)
    if window is not None:
        lo = torch.clamp(layout.q_pos - window + 1, min=0)
    if chunk is not None:
        lo = torch.maximum(lo, layout.q_pos // chunk * chunk)
    return lo, layout.q_pos


def build_paged_mask(
    layout: StepLayout,
    num_cache_blocks: int,
    window: int | None,
    chunk: int | None,
    q_block_size: int,
    compact: bool,
) -> PagedMask:
    """The step's BlockMask in the physical or the compact page space (module docstring)."""
    bs = layout.block_size
    device = layout.blocks.device
    blocks = layout.blocks
    num_reqs, max_blocks = blocks.shape
    real = blocks > 0  # block 0 is the null block: never a page of any request
    pages: torch.Tensor | None = None
    if compact:
        pages = torch.unique(blocks[real])  # ascending block ids
        to_page = torch.full((num_cache_blocks,), -1, dtype=torch.int64, device=device)
        to_page[pages] = torch.arange(len(pages), device=device)
        page_of = torch.where(real, to_page[blocks.clamp(min=0)], -1)
        num_pages = len(pages)
    else:
        page_of = torch.where(real, blocks, -1)
        num_pages = num_cache_blocks
    # Inverse of the block tables. A page may sit in one table twice only as the null block (excluded), but
    # several requests share pages (prefix caching): hence one row per request.
    page_to_logical = torch.full((num_reqs, num_pages + 1), -1, dtype=torch.int64, device=device)
    logical = torch.arange(max_blocks, device=device).expand(num_reqs, -1)
    page_to_logical.scatter_reduce_(1, torch.where(page_of >= 0, page_of, num_pages), logical, reduce="amax")
    page_to_logical = page_to_logical[:, :num_pages].contiguous()

    lo, hi = visible_range(layout, window, chunk)
    mask_mod = _mask_mod(layout.q_req, layout.q_pos, page_to_logical, bs, window, chunk)
    num_tokens = layout.q_req.shape[0]
    num_q_blocks = -(-num_tokens // q_block_size)
    # Which pages each group of q_block_size rows may touch: the logical blocks of its rows' visible ranges.
    j = torch.arange(max_blocks, device=device)[None, :]
    row_pages = page_of[layout.q_req]  # [T, max_blocks]
    take = (j >= (lo // bs)[:, None]) & (j <= (hi // bs)[:, None]) & (row_pages >= 0)
    group = torch.arange(num_tokens, device=device) // q_block_size
    flat = group[:, None] * (num_pages + 1) + torch.where(take, row_pages, num_pages)
    touched = torch.zeros(num_q_blocks * (num_pages + 1), dtype=torch.bool, device=device)
    touched[flat.reshape(-1)] = True
    touched = touched.view(num_q_blocks, num_pages + 1)[:, :num_pages]
    kv_num_blocks = touched.sum(-1, dtype=torch.int32)
    # A bound known on the host (no device sync): a group touches at most all pages of its rows' tables.
    width = max(min(num_pages, q_block_size * max_blocks), 1)
    order = torch.where(touched, torch.arange(num_pages, device=device), num_pages).sort(-1).values[:, :width]
    kv_indices = torch.where(order < num_pages, order, 0).to(torch.int32)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        BLOCK_SIZE=(q_block_size, bs),
        mask_mod=mask_mod,
        seq_lengths=(num_tokens, num_pages * bs),
        compute_q_blocks=False,
    )
    return PagedMask(pages, block_mask)


def _mask_mod(
    q_req: torch.Tensor, q_pos: torch.Tensor, page_to_logical: torch.Tensor, block_size: int,
    window: int | None, chunk: int | None,
) -> MaskMod:
    """visible(t, k) of the module docstring, in flex_attention's mask_mod form."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        logical = page_to_logical[q_req[q_idx], kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size
        here = q_pos[q_idx]
        ok = (logical >= 0) & (pos <= here)
        if window is not None:
            ok = ok & (pos > here - window)
        if chunk is not None:
            ok = ok & (pos // chunk == here // chunk)
        return ok

    return mask_mod
