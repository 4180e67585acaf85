"""Fused mixture-of-experts on CUDA: grouped GEMMs over token-expert pairs sorted by expert (vLLM's fused_moe).

    fused_moe(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K] f32, topk_ids [T, K] i32,
              activation="silu", w13_bias [E, 2I] | None, w2_bias [E, H] | None,
              swiglu_limit=None, swiglu_alpha=None) -> [T, H]

    out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])
    expert_e(x) = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]      w13 rows [0, I) gate, [I, 2I) up
    act         "silu": silu(gate) * up; "gelu": gelu(gate) * up (erf); "swigluoai" (gpt-oss):
                gate = min(gate, limit), up = clamp(up, +-limit), (up + 1) * gate * sigmoid(alpha * gate)
The contract (shapes, activation names, the swigluoai defaults) is pagedllm.layers.moe_reference's, whose
check_moe_args this op runs too; the torch reference there is what this kernel must equal.

Four launches, none waiting on the host (so a CUDA graph holds the layer):
  1-2. moe_align_block_size (moe_align.py): the T*K pairs sorted by expert, each expert's run padded to BLOCK_M
  3.   gate/up GEMM: per tile, BLOCK_M rows of hidden (gathered through the sorted pair ids) times that block's
       expert's gate and up columns, + bias, the activation -> act [T*K, I] (row = the pair's flat index)
  4.   down GEMM: act rows times w2[expert] + bias, times the pair's routing weight -> [T*K, H]
  then the sum over k (torch; a view when K = 1).
Tile sizes: moe_kernel_config.py (a table by rows per expert; override_config to force one).

Imported only where the kernel is about to run: it imports triton. On the CPU it runs under TRITON_INTERPRET=1
(the tests); the CPU path of the model layers is the torch reference, not this.

NOTE 1 (vLLM's layout): the pair ids index the flat [T * K] pairs, so the hidden row of a pair is id // K and
the intermediate rows need no scatter: kernel 3 writes row id, kernel 4 reads row id and writes row id, and
the sum over k reads [T, K, H] contiguously. Padding slots hold id T*K and are masked off everywhere.

NOTE 2 (activation fused into the gate/up GEMM): each program accumulates the gate columns [n, n + BN/2) and
the up columns [I + n, I + n + BN/2) of the same rows side by side, so the activation is applied in registers
and only act (I columns) is written: no [T*K, 2I] intermediate and no separate activation launch (vLLM writes
the 2I columns, then silu_and_mul reads them back). BLOCK_N counts both halves, so a tile's footprint is the
one vLLM's table tunes.

NOTE 3 (rounding): gate, up, bias and the activation stay in float32 from the accumulators; act is rounded once
to the input dtype, the down GEMM accumulates in float32, adds the bias and multiplies the routing weight
before its one rounding; the sum over k is torch's (float32 accumulation, one rounding). A torch reference in
the input dtype rounds after each op, so on half types the two agree to a few ulps, not bit for bit.
float32 inputs use IEEE dot products (tl.dot's default on CUDA is TF32, ~1e-3 off): float32 here is the
checking dtype, not the fast one.

NOTE 4 (one binary per config): the sizes that change with the batch (slot count, pair count) are not
specialized on (Triton would build another binary each time one of them turns divisible by 16 or equal to
1); the model's sizes (H, I, strides) are, once per model, and they are what the loads' vectorization needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.compile_ahead import launch
from pagedllm.layers.moe_align import moe_align_block_size
from pagedllm.layers.moe_kernel_config import MoeKernelConfig, config_for
from pagedllm.layers.moe_reference import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, check_moe_args

_ACT_CODES = {"silu": 0, "gelu": 1, "swigluoai": 2}  # the kernel's ACT constexpr
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _tile(pid, EM, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program pid, GROUP_M row blocks per column sweep: the programs running
    at once share their experts' weight tiles in L2 (the grouped order of Triton's matmul tutorial)."""
    num_m = tl.cdiv(EM, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % rows, (pid % in_group) // rows


@triton.jit(do_not_specialize=["EM", "num_pairs"])  # NOTE 4
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ids_ptr, total_ptr,
    N, K, EM, num_pairs,
    stride_xm, stride_we, stride_wn, stride_be, stride_om,
    limit, alpha,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_N // 2  # NOTE 2: gate and up halves of one tile
    pid_m, pid_n = _tile(tl.program_id(0), EM, N, BLOCK_M, HALF, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the padded rows of this routing (the grid is sized for the worst one)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * HALF + tl.arange(0, HALF)
    col = offs_n % N  # in-bounds columns for the loads; the tail's results are masked at the store
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xm + offs_k[None, :]  # NOTE 1: hidden row = pair // K
    g_ptrs = w_ptr + expert * stride_we + col[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    gate = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        gate = tl.dot(a, g, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, u, up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_be + col).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + expert * stride_be + N + col).to(tl.float32)[None, :]
    if ACT == 0:  # silu
        act = gate * tl.sigmoid(gate) * up
    elif ACT == 1:  # gelu (erf)
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:  # swigluoai
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["EM", "num_pairs"])  # NOTE 4
def _down_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, total_ptr,
    N, K, EM, num_pairs,
    stride_am, stride_we, stride_wn, stride_be, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair[:, None] * stride_am + offs_k[None, :]  # NOTE 1: act row = the pair itself
    w_ptrs = w_ptr + expert * stride_we + col[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + col).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pair, mask=pair_ok, other=0.0)[:, None]  # the routing weight, before rounding
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & (offs_n < N)[None, :])


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum for every token, [T, H] in hidden's dtype (module doc)."""
    tokens, hidden_size, experts, inter, top_k = _check(
        hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit, swiglu_alpha
    )
    if tokens == 0:
        return hidden.new_empty(0, hidden_size)
    hidden = hidden.contiguous()
    weights = topk_weights.contiguous()
    cfg = config_for(tokens, top_k, experts)
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, cfg.block_m, experts)
    em = sorted_ids.numel()
    pairs = tokens * top_k
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # NOTE 3 (ignored for half types)

    act = hidden.new_empty(pairs, inter)
    b13 = w13_bias if w13_bias is not None else act  # never read without HAS_BIAS
    launch(
        _gate_up_kernel, (triton.cdiv(em, cfg.block_m) * triton.cdiv(inter, cfg.block_n // 2),),
        hidden, w13, b13, act, sorted_ids, expert_ids, total,
        inter, hidden_size, em, pairs,
        hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), act.stride(0),
        float(SWIGLUOAI_LIMIT if swiglu_limit is None else swiglu_limit),
        float(SWIGLUOAI_ALPHA if swiglu_alpha is None else swiglu_alpha),
        TOP_K=top_k, HAS_BIAS=w13_bias is not None, ACT=_ACT_CODES[activation], DOT_PRECISION=precision,
        **_tiles(cfg),
    )
    down = hidden.new_empty(pairs, hidden_size)
    b2 = w2_bias if w2_bias is not None else down
    down_n = cfg.down_block_n or cfg.block_n
    launch(
        _down_kernel, (triton.cdiv(em, cfg.block_m) * triton.cdiv(hidden_size, down_n),),
        act, w2, b2, down, weights, sorted_ids, expert_ids, total,
        hidden_size, inter, em, pairs,
        act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0), down.stride(0),
        HAS_BIAS=w2_bias is not None, DOT_PRECISION=precision, **_tiles(cfg, down_n),
    )
    if top_k == 1:
        return down
    return down.view(tokens, top_k, hidden_size).sum(dim=1)


def _tiles(cfg: MoeKernelConfig, block_n: int | None = None) -> dict[str, int]:
    return {"BLOCK_M": cfg.block_m, "BLOCK_N": block_n or cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _check(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float | None,
) -> tuple[int, int, int, int, int]:
    """(T, H, E, I, K) once every argument is what the kernels read; a ValueError naming the argument if not:
    the reference's contract (check_moe_args), then what the kernels add to it (dtypes, strides, devices)."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, swiglu_limit,
                   swiglu_alpha)
    if activation not in _ACT_CODES:
        raise ValueError(f"fused_moe: activation {activation!r} has no Triton kernel ({', '.join(_ACT_CODES)})")
    if hidden.dtype not in _DTYPES:
        raise ValueError(f"fused_moe: hidden must be float16, bfloat16 or float32, got {hidden.dtype}")
    tokens, hidden_size = hidden.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden.dtype:
            raise ValueError(f"fused_moe: {name} is {w.dtype}, hidden is {hidden.dtype}")
        if w.stride(2) != 1:  # a silent copy of an expert stack would double its memory
            raise ValueError(f"fused_moe: {name} needs a unit last stride, got strides {w.stride()}")
    for name, bias in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if bias is not None and (not bias.dtype.is_floating_point or bias.stride(1) != 1):
            raise ValueError(f"fused_moe: {name} must be floating point with a unit last stride, got "
                             f"{bias.dtype} strides {bias.stride()}")
    tensors = [hidden, w13, w2, topk_weights, topk_ids] + [b for b in (w13_bias, w2_bias) if b is not None]
    if any(t.device != hidden.device for t in tensors):
        raise ValueError(f"fused_moe: every tensor must be on {hidden.device}, got "
                         f"{sorted({str(t.device) for t in tensors})}")
    # moe_align NOTE 2: an id outside [0, E) would get no slot and leave its output row unwritten. Checked
    # where it is free; on CUDA the check would stall every layer on a device-to-host copy.
    if hidden.device.type == "cpu" and topk_ids.numel() and not (
        int(topk_ids.min()) >= 0 and int(topk_ids.max()) < experts
    ):
        raise ValueError(f"fused_moe: topk_ids must be in [0, {experts}), got [{int(topk_ids.min())}, "
                         f"{int(topk_ids.max())}]")
    return tokens, hidden_size, experts, inter, topk_ids.shape[1]
