"""Fresh-prefill attention: causal attention of requests whose keys are ALL new in this step, read from the
step's own contiguous key/value tensors instead of the paged cache (as vLLM's FlashInfer backend runs its
ragged prefill).

A request is fresh when nothing was cached before this step (seq_len == query_len: a prompt with no prefix
hit, or the first chunk of a chunked prompt). Its keys are then exactly the rows of `key` / `value`
[num_tokens, kv_heads, head] that reshape_and_cache writes into the pages, so attention needs no block table:
K/V are plain 2-D strided tensors [num_tokens, kv_heads * head] that a TMA descriptor can fetch a
[TILE_N, HEAD] box at a time, which lets Triton's Hopper pipeliner (and its automatic warp specialization,
which only partitions descriptor loads) run the loop the way its own fused-attention tutorial does. The
unified paged kernel (triton/kernels.py) gathers keys page by page through the block table and can do
neither (docs/perf-notes.md 10).

Program = (query block, KV head) with packed GQA (rows = BLOCK_Q tokens x the G query heads of one KV head,
so one K/V tile feeds G heads) or (query block, query head) without. The requests handled are a run of the
step's requests; a host plan (plan_blocks, built once per step and shared by the layers) lists every query
block as (request's first row, its length, the block's first position), heaviest blocks first, so the grid
is exact and a program finds its block with three loads -- no binary search (a loop before the key loop
stops Triton's warp specialization: the WARP_SPEC NOTE in the kernel). Request i's query row at local
position p sees keys 0..p (and, with a window W, only keys > p - W); key position j is row start_i + j.

Numerics are the unified kernel's: scores in log2 units (exp2), online softmax and the accumulator in
float32, P cast to the input dtype for the second dot, tiles before the block's first query position
without a mask, only the diagonal tiles (every tile with a window) masked. Tiles that run past a request's
last key read the next request's rows (masked out: they lie after every query of the block) or, past the
tensor's end, TMA's zero fill (the pointer path masks them).

K/V loading (config `kv_load`): "host" = TensorDescriptor built on the host (a CUtensorMap kernel argument),
"device" = tl.make_tensor_descriptor in the kernel (needs triton's scratch allocator; the variant Triton's
tutorial uses for warp specialization on Hopper), "pointer" = plain masked pointer loads of the same rows
(no TMA; the comparison point). All three run under Triton's CPU interpreter.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import triton
import triton.language as tl

from pagedllm.api.kernels import launch
from pagedllm.plugins.attention.triton.kernels import softcap_log2, softmax_step
from pagedllm.plugins.attention.triton.tuning import FRESH_PREFILL, FreshPrefillConfig


@triton.jit
def _fresh_tile(
    q, acc, m_i, l_i, k_src, v_src, start_n, key_row0, col, num_rows, q_pos, offs_n, offs_d,
    stride_kt, stride_vt, qk_scale, soft_cap, window,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, TMA: tl.constexpr,
):
    """One TILE_N-key step of the online softmax (scores in log2 units); returns the new (acc, m, l).

    `start_n` is the tile's first key position within the request, `key_row0` its row in key/value.
    """
    if TMA:
        k = k_src.load([key_row0, col])  # [TILE_N, HEAD]; rows past the tensor: zeros
        v = v_src.load([key_row0, col])
    else:
        rows = key_row0 + offs_n
        k_ptrs = k_src + rows.to(tl.int64)[:, None] * stride_kt + col + offs_d[None, :]
        v_ptrs = v_src + rows.to(tl.int64)[:, None] * stride_vt + col + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=(rows < num_rows)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=(rows < num_rows)[:, None], other=0.0)
        else:  # a tile wholly before the block's first query: inside the request
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k))
    if USE_SOFTCAP:
        s = softcap_log2(s, qk_scale, soft_cap)
    if MASKED:
        key_pos = start_n + offs_n
        visible = key_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    p, alpha, m_new = softmax_step(s, m_i, qk_scale, USE_SOFTCAP)
    # acc scaled then accumulated by the dot itself (no second [BLOCK_M, HEAD] float32 tile live), l last:
    # both as Triton's fused-attention tutorial orders them, to keep registers down.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_rows"])
def _fresh_prefill_kernel(
    q_src, k_src, v_src, out_ptr, plan_ptr,
    num_rows, scale, soft_cap, window,
    stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, PACK_GQA: tl.constexpr, TMA: tl.constexpr, DEVICE_DESC: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    # The block's request and position from the host plan (plan_blocks): no search, no spare programs.
    blk = plan_ptr + tl.program_id(0) * 3
    q_start = tl.load(blk)
    q_len = tl.load(blk + 1)
    block_first = tl.load(blk + 2)
    # without packing, axis 1 is the query head; its rows are BLOCK_M tokens of that head
    kv_head = tl.program_id(1) if PACK_GQA else tl.program_id(1) // G

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    offs_n = tl.arange(0, TILE_N)
    if PACK_GQA:
        q_pos = block_first + offs_m // G
        head = kv_head * G + offs_m % G
    else:
        q_pos = block_first + offs_m
        head = tl.full([BLOCK_M], 0, tl.int32) + tl.program_id(1)
    row_ok = q_pos < q_len
    rows = (q_start + q_pos).to(tl.int64)

    if TMA and DEVICE_DESC:
        k_src = tl.make_tensor_descriptor(k_src, shape=[num_rows, KV_HEADS * HEAD], strides=[stride_kt, 1],
                                          block_shape=[TILE_N, HEAD])
        v_src = tl.make_tensor_descriptor(v_src, shape=[num_rows, KV_HEADS * HEAD], strides=[stride_vt, 1],
                                          block_shape=[TILE_N, HEAD])
        if not PACK_GQA:
            q_src = tl.make_tensor_descriptor(q_src, shape=[num_rows, NUM_HEADS * HEAD], strides=[stride_qt, 1],
                                              block_shape=[BLOCK_M, HEAD])
    if TMA and not PACK_GQA:
        # One head's BLOCK_M consecutive tokens: one box (rows past the request are the next one's, unused).
        q = q_src.load([q_start + block_first, tl.program_id(1) * HEAD])
    else:
        q = tl.load(q_src + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
    col = kv_head * HEAD

    # Keys up to the block's last query (the causal frontier), at most q_len; from the window's first.
    last = tl.minimum(block_first + BLOCK_Q, q_len)
    tile_lo = 0
    if USE_WINDOW:
        tile_lo = tl.maximum(block_first - window + 1, 0) // TILE_N
    tile_hi = (last + TILE_N - 1) // TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD], 0.0, tl.float32)
    qk_scale = scale * 1.4426950408889634
    if WARP_SPEC:
        # NOTE (warp specialization, Triton 3.6 on sm_90, found by compiling offline): the Hopper pass splits
        # ONE loop into a TMA producer warpgroup and two consumer warpgroups of BLOCK_M / 2 rows (num_warps 4
        # becomes 12), and only when: a single such loop, no early exit and no while loop before it (the
        # host plan replaces the unified kernel's binary search), Q from a descriptor (a pointer-loaded or
        # reshaped Q crashes the pass's data partitioning: hence one head per program), num_warps 4 (8 is
        # left unspecialized). So here every tile is masked. The descriptors are made in the kernel: with a
        # host descriptor for Q, Triton 3.9's partitioning halves the rows but keeps the box (a compile error;
        # 3.6 builds both), as Triton's tutorial also builds them on the device for Hopper.
        for tile in tl.range(tile_lo, tile_hi, warp_specialize=True):
            acc, m_i, l_i = _fresh_tile(
                q, acc, m_i, l_i, k_src, v_src, tile * TILE_N, q_start + tile * TILE_N, col, num_rows, q_pos,
                offs_n, offs_d, stride_kt, stride_vt, qk_scale, soft_cap, window,
                True, USE_WINDOW, USE_SOFTCAP, TMA,
            )
    else:
        # Tiles wholly at or before the block's first query are visible to every row: no mask (not with a
        # window, where every tile is masked).
        full_hi = tile_lo
        if not USE_WINDOW:
            full_hi = tl.minimum((block_first + 1) // TILE_N, tile_hi)
        for tile in range(tile_lo, full_hi):
            acc, m_i, l_i = _fresh_tile(
                q, acc, m_i, l_i, k_src, v_src, tile * TILE_N, q_start + tile * TILE_N, col, num_rows, q_pos,
                offs_n, offs_d, stride_kt, stride_vt, qk_scale, soft_cap, window,
                False, USE_WINDOW, USE_SOFTCAP, TMA,
            )
        for tile in range(full_hi, tile_hi):
            acc, m_i, l_i = _fresh_tile(
                q, acc, m_i, l_i, k_src, v_src, tile * TILE_N, q_start + tile * TILE_N, col, num_rows, q_pos,
                offs_n, offs_d, stride_kt, stride_vt, qk_scale, soft_cap, window,
                True, USE_WINDOW, USE_SOFTCAP, TMA,
            )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def plan_blocks(run_starts: np.ndarray, block_q: int) -> np.ndarray:
    """int32 [num_blocks, 3] (request's first row, its query length, the block's first position) for the
    requests whose query_start_loc slice (host, absolute rows) is `run_starts`, longest causal blocks first.

    NOTE: the order is the grid's dispatch order, so sorting by keys per block (descending) is longest-
    processing-time-first scheduling over the whole step -- the unified kernel's REVERSE does the same per
    request -- and the last wave is of short blocks, not of a long request's final ones.
    """
    starts = run_starts[:-1].astype(np.int64)
    lens = np.diff(run_starts).astype(np.int64)
    counts = -(-lens // block_q)
    req = np.repeat(np.arange(len(lens)), counts)
    first = (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)) * block_q
    keys = np.minimum(first + block_q, lens[req])
    order = np.argsort(-keys, kind="stable")
    return np.stack([starts[req], lens[req], first], axis=1)[order].astype(np.int32)


def supports(head: int, dtype: torch.dtype) -> bool:
    """Shapes the kernel takes: a power-of-two head of 16..256 (one TMA box per key row, no padding columns)
    and a floating-point input the dots accept."""
    return 16 <= head <= 256 and head & (head - 1) == 0 and dtype in (torch.float16, torch.bfloat16, torch.float32)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA's rules for [T, heads, head] tensors viewed as [T, heads * head]: a 16-byte base and row stride,
    heads packed (stride(1) == head), the last dim contiguous. Host values only (no device sync)."""
    for x in tensors:
        size = x.element_size()
        if x.stride(-1) != 1 or x.stride(1) != x.shape[2] or x.data_ptr() % 16 or (x.stride(0) * size) % 16:
            return False
    return True


def launch_shape(config: FreshPrefillConfig, group: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_Q, TILE_N, pack_gqa) of a configuration for G = `group` (warp specialization implies
    one head per program: the WARP_SPEC NOTE in the kernel). The interpreter's default tiles are small."""
    pack = config.pack_gqa and not config.warp_specialize
    block_m = max(16, config.rows, triton.next_power_of_2(group) if pack else 16)
    return block_m, (block_m // group if pack else block_m), config.tile_n, pack


def fresh_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head]
    key: torch.Tensor,  # [T, kv_heads, head]: the step's new keys (rows 0 .. num_rows - 1 valid)
    value: torch.Tensor,  # [T, kv_heads, head]
    out: torch.Tensor,  # [T, num_heads, head]
    plan: torch.Tensor,  # int32 [num_blocks, 3] on the device: plan_blocks(..., launch_shape(...)[1])
    num_rows: int,  # valid rows of query/key/value (the step's actual tokens)
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    config: FreshPrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of the planned fresh requests over their own keys in `key`/`value`; writes their rows
    of `out` (module docstring). TMA modes fall back to pointer loads where `tma_ok` fails."""
    _, num_heads, head = query.shape
    kv_heads = key.shape[1]
    group = num_heads // kv_heads
    assert supports(head, query.dtype), f"fresh prefill: head {head} / {query.dtype} not supported"
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and key.stride(1) == head and value.stride(1) == head
    cfg = config or default_config()
    block_m, block_q, tile, pack = launch_shape(cfg, group)
    mode = cfg.kv_load if tma_ok(query, key, value) else "pointer"
    if cfg.warp_specialize and mode == "host":
        mode = "device"  # the WARP_SPEC NOTE in the kernel: Triton 3.9 cannot split a host Q descriptor's box
    q_src: object = query
    k_src: object = key
    v_src: object = value
    if mode == "host":
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(x: torch.Tensor, rows: int) -> TensorDescriptor:
            return TensorDescriptor(x, [num_rows, x.shape[1] * head], [x.stride(0), 1], [rows, head])

        k_src, v_src = desc(key, tile), desc(value, tile)
        if not pack:
            q_src = desc(query, block_m)
    elif mode == "device":
        _set_allocator(query.device)
    grid = (plan.shape[0], kv_heads if pack else num_heads)
    launch(
        _fresh_prefill_kernel, grid,
        q_src, k_src, v_src, out, plan,
        num_rows, scale, soft_cap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), key.stride(0), value.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, G=group, HEAD=head, BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE_N=tile, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=soft_cap is not None, PACK_GQA=pack,
        TMA=mode != "pointer", DEVICE_DESC=mode == "device", WARP_SPEC=cfg.warp_specialize and mode != "pointer",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _set_allocator(device: torch.device) -> None:
    """Device-side descriptors live in a per-launch global scratch that Triton asks its allocator for (a
    context variable: set in the calling thread, here at the launch, never at import)."""
    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)


def default_config() -> FreshPrefillConfig:
    """triton_tuning.FRESH_PREFILL, with 16-row, 16-key tiles under the interpreter (more tiles per test)."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return replace(FRESH_PREFILL, rows=16, tile_n=16)
    return FRESH_PREFILL
