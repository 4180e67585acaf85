"""Triton kernels for a Mamba layer's decode step: the conv1d state update and the selective state update.

Both read and write each request's state in place through its state slot, need no host sync (CUDA graphs
can capture them) and match the torch code in mamba_conv1d.py / mamba_selective_scan.py, which is their
reference in tests (tests/test_mamba_triton.py, under TRITON_INTERPRET=1 on the CPU). Math in float32.

Imported only when a CUDA tensor reaches pagedllm.plugins.models.mamba.ops (or by the tests): importing this module
imports triton.

NOTE: a batch may name one slot twice only for CUDA-graph padding rows, which all use the null block's
slot 0; their writes race, which is harmless because nothing reads the null block's state (a request with
a fresh state reads zeros, not its slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):  # type: ignore[no-untyped-def]
    # torch's F.softplus with its default threshold 20: identity above it (exp would overflow in fp32).
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


@triton.jit
def _conv1d_update_kernel(  # type: ignore[no-untyped-def]
    x_ptr, state_ptr, w_ptr, bias_ptr, slot_ptr, has_ptr, out_ptr,
    dim,
    stride_xb, stride_xd,
    stride_ss, stride_sd, stride_sk,
    stride_wd, stride_wk,
    stride_ob, stride_od,
    KERNEL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SILU: tl.constexpr,
):
    """One request (program axis 0) x BLOCK_D channels (axis 1): out = act(w . [state, x]); state <<= x."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, BLOCK_K)  # state columns 0 .. KERNEL - 2, padded to a power of two
    d_ok = d < dim
    k_ok = k < KERNEL - 1
    slot = tl.load(slot_ptr + b).to(tl.int64)
    keep = 1.0
    if HAS_MASK:
        keep = tl.load(has_ptr + b).to(tl.float32)
    s_ptrs = state_ptr + slot * stride_ss + d[:, None] * stride_sd + k[None, :] * stride_sk
    tile_ok = d_ok[:, None] & k_ok[None, :]
    state = tl.load(s_ptrs, mask=tile_ok, other=0.0).to(tl.float32) * keep  # [BLOCK_D, BLOCK_K]
    x = tl.load(x_ptr + b * stride_xb + d * stride_xd, mask=d_ok, other=0.0).to(tl.float32)
    w_state = tl.load(w_ptr + d[:, None] * stride_wd + k[None, :] * stride_wk, mask=tile_ok, other=0.0)
    w_last = tl.load(w_ptr + d * stride_wd + (KERNEL - 1) * stride_wk, mask=d_ok, other=0.0)
    acc = tl.sum(state * w_state.to(tl.float32), axis=1) + x * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    # Shifted state: column j takes old column j + 1; the last column takes x. Read before any write.
    shifted = tl.load(s_ptrs + stride_sk, mask=d_ok[:, None] & (k[None, :] < KERNEL - 2), other=0.0)
    shifted = shifted.to(tl.float32) * keep
    new_state = tl.where(k[None, :] == KERNEL - 2, x[:, None], shifted)
    tl.store(s_ptrs, new_state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(out_ptr + b * stride_ob + d * stride_od, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def triton_conv1d_update(
    x: torch.Tensor,  # [B, D]
    conv_states: torch.Tensor,  # [S, D, K - 1], updated in place
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,  # [B]
    has_initial_state: torch.Tensor | None = None,  # [B] bool
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton version of pagedllm.plugins.models.mamba.conv1d.causal_conv1d_update (same arguments, same result)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv1d activation '{activation}' is not supported (silu or none)")
    batch, dim = x.shape
    kernel = weight.shape[1]
    if kernel < 2:
        raise ValueError(f"conv kernel {kernel}: the Triton update needs a state (kernel >= 2)")
    out = torch.empty_like(x)
    if batch == 0:
        return out
    block_d = min(128, triton.next_power_of_2(dim))
    grid = (batch, triton.cdiv(dim, block_d))
    _conv1d_update_kernel[grid](
        x, conv_states, weight, bias if bias is not None else weight, state_indices,
        has_initial_state if has_initial_state is not None else state_indices, out,
        dim,
        x.stride(0), x.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1),
        KERNEL=kernel, BLOCK_D=block_d, BLOCK_K=triton.next_power_of_2(kernel - 1),
        HAS_BIAS=bias is not None, HAS_MASK=has_initial_state is not None, SILU=activation is not None,
    )
    return out


@triton.jit
def _state_update_kernel(  # type: ignore[no-untyped-def]
    state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dt_bias_ptr, slot_ptr, has_ptr, out_ptr,
    head_dim, state_size, heads_per_group,
    stride_ss, stride_sh, stride_sp, stride_sn,
    stride_xb, stride_xh, stride_xp,
    stride_dtb, stride_dth, stride_dtp,
    stride_ah, stride_ap, stride_an,
    stride_bb, stride_bg, stride_bn,
    stride_cb, stride_cg, stride_cn,
    stride_dh, stride_dp,
    stride_zb, stride_zh, stride_zp,
    stride_dbh, stride_dbp,
    stride_ob, stride_oh, stride_op,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """BLOCK_P channels (axis 0) of head h (axis 2) of request b (axis 1): one step of the recurrence."""
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < head_dim
    n_ok = n < state_size
    tile_ok = p_ok[:, None] & n_ok[None, :]
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn
    state = tl.load(s_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        state = state * tl.load(has_ptr + b).to(tl.float32)
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + p * stride_xp, mask=p_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dtb + h * stride_dth + p * stride_dtp, mask=p_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h * stride_dbh + p * stride_dbp, mask=p_ok, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    A = tl.load(
        a_ptr + h * stride_ah + p[:, None] * stride_ap + n[None, :] * stride_an, mask=tile_ok, other=0.0
    ).to(tl.float32)
    B = tl.load(b_ptr + b * stride_bb + g * stride_bg + n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
    C = tl.load(c_ptr + b * stride_cb + g * stride_cg + n * stride_cn, mask=n_ok, other=0.0).to(tl.float32)
    state = state * tl.exp(A * dt[:, None]) + (dt * x)[:, None] * B[None, :]
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    y = tl.sum(state * C[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(d_ptr + h * stride_dh + p * stride_dp, mask=p_ok, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + b * stride_zb + h * stride_zh + p * stride_zp, mask=p_ok, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + p * stride_op, y.to(out_ptr.dtype.element_ty), mask=p_ok)


def triton_selective_state_update(
    state: torch.Tensor,  # [S, H, P, N], updated in place
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H, P]
    A: torch.Tensor,  # [H, P, N]
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    state_indices: torch.Tensor,  # [B]
    D: torch.Tensor | None = None,  # [H, P]
    z: torch.Tensor | None = None,  # [B, H, P]
    dt_bias: torch.Tensor | None = None,  # [H, P]
    dt_softplus: bool = False,
    has_initial_state: torch.Tensor | None = None,  # [B] bool
) -> torch.Tensor:
    """Triton version of pagedllm.plugins.models.mamba.selective_scan.selective_state_update (same arguments)."""
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} B/C groups")
    out = torch.empty_like(x)
    if batch == 0:
        return out
    block_n = triton.next_power_of_2(state_size)
    # Keep the [BLOCK_P, BLOCK_N] state tile within ~4k elements (registers), at least 16 rows.
    block_p = max(16, min(triton.next_power_of_2(head_dim), 4096 // block_n))
    grid = (triton.cdiv(head_dim, block_p), batch, heads)
    # Absent optional tensors: pass any tensor for the pointer and zero strides (the kernel never reads it).
    d_t = D if D is not None else x.new_empty(0)
    z_t = z if z is not None else x.new_empty(0)
    db_t = dt_bias if dt_bias is not None else x.new_empty(0)

    def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
        return tuple(t.stride()) if t is not None else (0,) * n

    _state_update_kernel[grid](
        state, x, dt, A, B, C, d_t, z_t, db_t, state_indices,
        has_initial_state if has_initial_state is not None else state_indices, out,
        head_dim, state_size, heads // groups,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *strides(D, 2), *strides(z, 3), *strides(dt_bias, 2), *out.stride(),
        BLOCK_P=block_p, BLOCK_N=block_n,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        HAS_MASK=has_initial_state is not None,
    )
    return out


@triton.jit
def _scan_varlen_kernel(  # type: ignore[no-untyped-def]
    state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dt_bias_ptr, slot_ptr, has_ptr, qsl_ptr, out_ptr,
    head_dim, state_size, heads_per_group, dt_min, dt_max,
    stride_ss, stride_sh, stride_sp, stride_sn,
    stride_xt, stride_xh, stride_xp,
    stride_dtt, stride_dth, stride_dtp,
    stride_ah, stride_ap, stride_an,
    stride_bt, stride_bg, stride_bn,
    stride_ct, stride_cg, stride_cn,
    stride_dh, stride_dp,
    stride_zt, stride_zh, stride_zp,
    stride_dbh, stride_dbp,
    stride_ot, stride_oh, stride_op,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    """BLOCK_P channels (axis 0) of head h (axis 2) of request r (axis 1): the recurrence over its rows.

    The [BLOCK_P, BLOCK_N] state stays in registers for the whole request; each row costs one read of x,
    dt, B, C (and z) and one write of y. Sequential in time, parallel over requests, heads and channels.
    """
    pid_p = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < head_dim
    n_ok = n < state_size
    tile_ok = p_ok[:, None] & n_ok[None, :]
    start = tl.load(qsl_ptr + r).to(tl.int64)
    end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn
    state = tl.load(s_ptrs, mask=tile_ok, other=0.0).to(tl.float32) * tl.load(has_ptr + r).to(tl.float32)
    A = tl.load(
        a_ptr + h * stride_ah + p[:, None] * stride_ap + n[None, :] * stride_an, mask=tile_ok, other=0.0
    ).to(tl.float32)
    dt_bias = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + h * stride_dbh + p * stride_dbp, mask=p_ok, other=0.0).to(tl.float32)
    D = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_D:
        D = tl.load(d_ptr + h * stride_dh + p * stride_dp, mask=p_ok, other=0.0).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + p * stride_xp, mask=p_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dtt + h * stride_dth + p * stride_dtp, mask=p_ok, other=0.0)
        dt = dt.to(tl.float32) + dt_bias
        if DT_SOFTPLUS:
            dt = _softplus(dt)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        B = tl.load(b_ptr + t * stride_bt + g * stride_bg + n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(c_ptr + t * stride_ct + g * stride_cg + n * stride_cn, mask=n_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(A * dt[:, None]) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(state * C[None, :], axis=1) + x * D
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_zt + h * stride_zh + p * stride_zp, mask=p_ok, other=0.0)
            z = z.to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + p * stride_op, y.to(out_ptr.dtype.element_ty), mask=p_ok)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)


def triton_scan_varlen(
    state: torch.Tensor,  # [S, H, P, N], updated in place
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H, P]
    A: torch.Tensor,  # [H, P, N]
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    query_start_loc: torch.Tensor,  # [R + 1] int, on x's device
    state_indices: torch.Tensor,  # [R]
    has_initial_state: torch.Tensor,  # [R] bool
    D: torch.Tensor | None = None,  # [H, P]
    z: torch.Tensor | None = None,  # [T, H, P]
    dt_bias: torch.Tensor | None = None,  # [H, P]
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (float("-inf"), float("inf")),
) -> torch.Tensor:  # [T, H, P]
    """The prefill recurrence for varlen requests, heads form (Mamba-1: H = 1; Mamba-2: scalars expanded).

    Same math as selective_scan_varlen (Mamba-1) and ssd_chunk_scan_varlen (Mamba-2), token by token: each
    request starts from its stored state (or zeros) and leaves its final state in its slot.
    """
    num_tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} B/C groups")
    out = torch.empty_like(x)
    num_reqs = state_indices.shape[0]
    if num_reqs == 0 or num_tokens == 0:
        return out
    block_n = triton.next_power_of_2(state_size)
    # The state tile lives in registers for the whole request: keep it near 2k elements.
    block_p = max(4, min(triton.next_power_of_2(head_dim), 2048 // block_n))
    grid = (triton.cdiv(head_dim, block_p), num_reqs, heads)
    d_t = D if D is not None else x.new_empty(0)
    z_t = z if z is not None else x.new_empty(0)
    db_t = dt_bias if dt_bias is not None else x.new_empty(0)

    def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
        return tuple(t.stride()) if t is not None else (0,) * n

    _scan_varlen_kernel[grid](
        state, x, dt, A, B, C, d_t, z_t, db_t, state_indices, has_initial_state, query_start_loc, out,
        head_dim, state_size, heads // groups, max(float(dt_limit[0]), -3.0e38), min(float(dt_limit[1]), 3.0e38),
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *strides(D, 2), *strides(z, 3), *strides(dt_bias, 2), *out.stride(),
        BLOCK_P=block_p, BLOCK_N=block_n,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
    )
    return out


@triton.jit
def _conv1d_varlen_kernel(  # type: ignore[no-untyped-def]
    x_ptr, state_ptr, w_ptr, bias_ptr, slot_ptr, has_ptr, qsl_ptr, out_ptr,
    dim,
    stride_xt, stride_xd,
    stride_ss, stride_sd, stride_sk,
    stride_wd, stride_wk,
    stride_ot, stride_od,
    KERNEL: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """Request r (axis 0) x BLOCK_D channels (axis 1): the causal conv over its rows, then its new state.

    Input position q of the request (q < 0: before this chunk) reads row start + q, or state column
    K - 1 + q (zero for a fresh request). Rows are re-read from global memory (cached) instead of shifting
    a register window.
    """
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    start = tl.load(qsl_ptr + r).to(tl.int64)
    length = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + r).to(tl.int64)
    keep = tl.load(has_ptr + r).to(tl.float32)
    s_base = state_ptr + slot * stride_ss + d * stride_sd
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    for t in range(0, length):
        acc = bias
        for k in tl.static_range(KERNEL):
            row = start + t - (KERNEL - 1) + k  # a row of x when >= start, else a state column
            in_x = (tl.zeros([BLOCK_D], dtype=tl.int64) + row) >= start  # as a vector: the interpreter
            # rejects a scalar condition inside a vector mask
            from_x = tl.load(x_ptr + row * stride_xt + d * stride_xd, mask=d_ok & in_x, other=0.0)
            from_s = tl.load(s_base + (KERNEL - 1 + row - start) * stride_sk, mask=d_ok & (~in_x), other=0.0)
            val = tl.where(in_x, from_x.to(tl.float32), from_s.to(tl.float32) * keep)
            w = tl.load(w_ptr + d * stride_wd + k * stride_wk, mask=d_ok, other=0.0).to(tl.float32)
            acc += w * val
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + t) * stride_ot + d * stride_od, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
    # New state column j = input position length - (K - 1) + j. A column still inside the old state
    # (position < 0) is old column length + j > j, which no earlier iteration of this loop has written.
    for j in tl.static_range(KERNEL - 1):
        row = start + length - (KERNEL - 1) + j
        in_x = (tl.zeros([BLOCK_D], dtype=tl.int64) + row) >= start
        from_x = tl.load(x_ptr + row * stride_xt + d * stride_xd, mask=d_ok & in_x, other=0.0)
        from_s = tl.load(s_base + (KERNEL - 1 + row - start) * stride_sk, mask=d_ok & (~in_x), other=0.0)
        val = tl.where(in_x, from_x.to(tl.float32), from_s.to(tl.float32) * keep)
        tl.store(s_base + j * stride_sk, val.to(state_ptr.dtype.element_ty), mask=d_ok)


def triton_conv1d_varlen(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,  # [S, D, K - 1], updated in place
    query_start_loc: torch.Tensor,  # [R + 1] int, on x's device
    state_indices: torch.Tensor,  # [R]
    has_initial_state: torch.Tensor,  # [R] bool
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton version of pagedllm.plugins.models.mamba.conv1d.causal_conv1d_varlen (device offsets and flags)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv1d activation '{activation}' is not supported (silu or none)")
    num_tokens, dim = x.shape
    kernel = weight.shape[1]
    if kernel < 2:
        raise ValueError(f"conv kernel {kernel}: the Triton conv needs a state (kernel >= 2)")
    out = torch.empty_like(x)
    num_reqs = state_indices.shape[0]
    if num_reqs == 0 or num_tokens == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    grid = (num_reqs, triton.cdiv(dim, block_d))
    _conv1d_varlen_kernel[grid](
        x, conv_states, weight, bias if bias is not None else weight, state_indices, has_initial_state,
        query_start_loc, out,
        dim,
        x.stride(0), x.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1),
        KERNEL=kernel, BLOCK_D=block_d, HAS_BIAS=bias is not None, SILU=activation is not None,
    )
    return out
