"""The Triton kernels of Mamba layers (decode: conv1d update, selective state update; prefill: varlen conv1d,
varlen scan) against the torch code, run by Triton's interpreter on the CPU, and compiled for sm_90.

As in test_triton_attention.py, the cases run in ONE child process started with TRITON_INTERPRET=1 (this file
run as a script), because the variable must be set before triton is first imported; the tests read its JSON.
Shapes stay small (the interpreter runs each program in numpy); fp32 and fp16 only (the interpreter's bf16
arithmetic is not the GPU's). examples/gpu/mamba_h200_check.py runs the same comparison at real sizes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# name -> options; fp32 is exact up to exp/log rounding, fp16 rounds the inputs and the stored state.
CASES: dict[str, dict[str, Any]] = {
    # Mamba-1 shaped: one head of 40 channels (not a power of two), state 16, fresh and continuing states
    "mamba1_fp32": {"heads": 1, "head_dim": 40, "groups": 1, "state": 16, "z": True, "dtype": "float32"},
    "mamba1_fp16": {"heads": 1, "head_dim": 40, "groups": 1, "state": 16, "z": True, "dtype": "float16"},
    # Mamba-2 shaped: 6 heads in 2 groups, scalars per head broadcast over P (stride-0 views), state 12
    "mamba2_fp32": {"heads": 6, "head_dim": 8, "groups": 2, "state": 12, "z": False, "dtype": "float32"},
    "mamba2_fp16": {"heads": 6, "head_dim": 8, "groups": 2, "state": 12, "z": False, "dtype": "float16"},
}
TOL = {"float32": 1e-5, "float16": 2e-3}


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    """Each kernel compiled for the H200 (sm_90) by Triton's own ptxas, in a child without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, "--compile"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_sm90(compiled: dict[str, Any]) -> None:
    """Catches what the interpreter cannot: a kernel that does not lower to GPU code (no GPU needed)."""
    if "skipped" in compiled:
        pytest.skip(compiled["skipped"])
    assert compiled == {name: "ok" for name in compiled} and len(compiled) == 5, compiled


@pytest.mark.parametrize("case", list(CASES))
def test_state_update_against_torch(interp: dict[str, Any], case: str) -> None:
    res = interp[f"ssu_{case}"]
    tol = TOL[CASES[case]["dtype"]]
    assert res["out"] < tol and res["state"] < tol, res
    assert res["other_slots_untouched"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_conv1d_update_against_torch(interp: dict[str, Any], dtype: str) -> None:
    res = interp[f"conv_{dtype}"]
    assert res["out"] < TOL[dtype] and res["state"] < TOL[dtype], res
    assert res["other_slots_untouched"]


@pytest.mark.parametrize("case", ["mamba1_fp32", "mamba1_fp16", "mamba2_fp32"])
def test_prefill_scan_against_torch(interp: dict[str, Any], case: str) -> None:
    res = interp[f"scan_{case}"]
    tol = 2e-3 if "fp16" in case else 1e-5
    assert res["out"] < tol and res["state"] < tol, res
    assert res["other_slots_untouched"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prefill_conv1d_against_torch(interp: dict[str, Any], dtype: str) -> None:
    res = interp[f"conv_varlen_{dtype}"]
    assert res["out"] < TOL[dtype] and res["state"] < TOL[dtype], res
    assert res["other_slots_untouched"]


# Prefill batches: a request longer than the conv window starting fresh, one token continuing a state, a
# short one (shorter than the conv window) continuing a state.
LENS, PREFILL_SLOTS, HAS = [6, 1, 2], [4, 1, 2], [False, True, True]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _ssu_case(heads: int, head_dim: int, groups: int, state: int, z: bool, dtype: str) -> dict[str, Any]:
    from pagedllm.plugins.models.mamba.selective_scan import selective_state_update
    from pagedllm.plugins.models.mamba.triton_kernels import triton_selective_state_update

    dt_ = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    batch, slots = 3, 6

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt_)

    states = rnd(slots, heads, head_dim, state)
    x, dt = rnd(batch, heads, head_dim), rnd(batch, heads, head_dim)
    if heads > 1:  # Mamba-2: one dt / A / D / bias per head, expanded over the head's channels (stride 0)
        dt = rnd(batch, heads)[:, :, None].expand(batch, heads, head_dim)
        A = (-torch.rand(heads, generator=gen) - 0.1)[:, None, None].expand(heads, head_dim, state)
        D, bias = rnd(heads)[:, None].expand(heads, head_dim), rnd(heads)[:, None].expand(heads, head_dim)
    else:
        A = -torch.rand(heads, head_dim, state, generator=gen) - 0.1
        D, bias = rnd(heads, head_dim), rnd(heads, head_dim)
    B, C = rnd(batch, groups, state), rnd(batch, groups, state)
    zz = rnd(batch, heads, head_dim) if z else None
    idx = torch.tensor([4, 1, 2])
    has = torch.tensor([True, False, True])
    ref_states, got_states = states.clone(), states.clone()
    kw = {"D": D, "z": zz, "dt_bias": bias, "dt_softplus": True, "has_initial_state": has}
    ref = selective_state_update(ref_states, x, dt, A, B, C, idx, **kw)
    got = triton_selective_state_update(got_states, x, dt, A, B, C, idx, **kw)
    others = [0, 3, 5]
    return {
        "out": _rel(got, ref),
        "state": _rel(got_states[idx], ref_states[idx]),
        "other_slots_untouched": bool(torch.equal(got_states[others], states[others])),
    }


def _conv_case(dtype: str) -> dict[str, Any]:
    from pagedllm.plugins.models.mamba.conv1d import causal_conv1d_update
    from pagedllm.plugins.models.mamba.triton_kernels import triton_conv1d_update

    dt_ = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1)
    dim, k, batch, slots = 150, 4, 3, 5  # 150 channels: two channel blocks, the second partial
    states = torch.randn(slots, dim, k - 1, generator=gen).to(dt_)
    x = torch.randn(batch, dim, generator=gen).to(dt_)
    w, b = torch.randn(dim, k, generator=gen).to(dt_), torch.randn(dim, generator=gen).to(dt_)
    idx, has = torch.tensor([3, 0, 1]), torch.tensor([True, True, False])
    ref_states, got_states = states.clone(), states.clone()
    ref = causal_conv1d_update(x, ref_states, w, b, idx, has)
    got = triton_conv1d_update(x, got_states, w, b, idx, has)
    others = [2, 4]
    return {
        "out": _rel(got, ref),
        "state": _rel(got_states[idx], ref_states[idx]),
        "other_slots_untouched": bool(torch.equal(got_states[others], states[others])),
    }


def _scan_case(kind: str, dtype: str) -> dict[str, Any]:
    from pagedllm.plugins.models.mamba.selective_scan import selective_scan_varlen
    from pagedllm.plugins.models.mamba.ssd import ssd_chunk_scan_varlen
    from pagedllm.plugins.models.mamba.triton_kernels import triton_scan_varlen

    dt_ = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(2)
    total, slots = sum(LENS), 6
    qsl = [0, 6, 7, 9]

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt_)

    idx, has = torch.tensor(PREFILL_SLOTS), torch.tensor(HAS)
    if kind == "mamba1":  # one head of 10 channels, per-channel A, z gate, no dt clamp
        p, n = 10, 6
        states = rnd(slots, p, n)
        x, dt, z = rnd(total, p), rnd(total, p), rnd(total, p)
        A = -torch.rand(p, n, generator=gen) - 0.1
        B, C, D, bias = rnd(total, n), rnd(total, n), rnd(p), rnd(p)
        ref_states, got_states = states.clone(), states.clone()
        ref = selective_scan_varlen(x, dt, A, B, C, ref_states, qsl, PREFILL_SLOTS, HAS, D=D, z=z,
                                    delta_bias=bias, delta_softplus=True)
        got = triton_scan_varlen(got_states[:, None], x[:, None], dt[:, None], A[None], B[:, None], C[:, None],
                                 torch.tensor(qsl), idx, has, D=D[None], z=z[:, None], dt_bias=bias[None],
                                 dt_softplus=True)[:, 0]
    else:  # Mamba-2: 4 heads x 3 in 2 groups, state 5, per-head scalars expanded, dt clamped to (0, 2)
        heads, p, g, n = 4, 3, 2, 5
        states = rnd(slots, heads, p, n)
        x, dt = rnd(total, heads, p), rnd(total, heads)
        A = -torch.rand(heads, generator=gen) - 0.1
        B, C, D, bias = rnd(total, g, n), rnd(total, g, n), rnd(heads), rnd(heads)
        ref_states, got_states = states.clone(), states.clone()
        ref = ssd_chunk_scan_varlen(x, dt, A, B, C, ref_states, qsl, PREFILL_SLOTS, HAS, 4, D=D, dt_bias=bias,
                                    dt_softplus=True, dt_limit=(0.0, 2.0))
        got = triton_scan_varlen(
            got_states, x, dt[:, :, None].expand(total, heads, p), A[:, None, None].expand(heads, p, n), B, C,
            torch.tensor(qsl), idx, has, D=D[:, None].expand(heads, p), dt_bias=bias[:, None].expand(heads, p),
            dt_softplus=True, dt_limit=(0.0, 2.0),
        )
    others = [0, 3, 5]
    return {
        "out": _rel(got, ref),
        "state": _rel(got_states[idx], ref_states[idx]),
        "other_slots_untouched": bool(torch.equal(got_states[others], states[others])),
    }


def _conv_varlen_case(dtype: str) -> dict[str, Any]:
    from pagedllm.plugins.models.mamba.conv1d import causal_conv1d_varlen
    from pagedllm.plugins.models.mamba.triton_kernels import triton_conv1d_varlen

    dt_ = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(3)
    dim, k, slots = 300, 4, 6  # two channel blocks of 256, the second partial
    states = torch.randn(slots, dim, k - 1, generator=gen).to(dt_)
    x = torch.randn(sum(LENS), dim, generator=gen).to(dt_)
    w, b = torch.randn(dim, k, generator=gen).to(dt_), torch.randn(dim, generator=gen).to(dt_)
    qsl = [0, 6, 7, 9]
    ref_states, got_states = states.clone(), states.clone()
    ref = causal_conv1d_varlen(x, w, b, ref_states, qsl, PREFILL_SLOTS, HAS)
    got = triton_conv1d_varlen(x, w, b, got_states, torch.tensor(qsl), torch.tensor(PREFILL_SLOTS),
                               torch.tensor(HAS))
    idx, others = torch.tensor(PREFILL_SLOTS), [0, 3, 5]
    return {
        "out": _rel(got, ref),
        "state": _rel(got_states[idx], ref_states[idx]),
        "other_slots_untouched": bool(torch.equal(got_states[others], states[others])),
    }


def _compile_all() -> dict[str, str]:
    """Compile every kernel for sm_90 with representative constexprs (Triton's internal compile API)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        return {"skipped": f"this triton has no offline compile API ({exc})"}
    from pagedllm.plugins.models.mamba import triton_kernels as mt

    ints = {"slot_ptr": "*i64", "has_ptr": "*i1", "qsl_ptr": "*i32"}

    def build(fn: Any, constexprs: dict[str, Any], data: str = "*fp32") -> str:
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ints.get(name, data)
            else:
                sig[name] = "fp32" if name in ("dt_min", "dt_max") else "i32"
        keys = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys), target=GPUTarget("cuda", 90, 32))
        return "ok"

    flags = {"HAS_D": True, "HAS_Z": True, "HAS_DT_BIAS": True, "DT_SOFTPLUS": True}
    return {
        "state_update": build(mt._state_update_kernel, {"BLOCK_P": 16, "BLOCK_N": 128, "HAS_MASK": True, **flags}),
        "conv1d_update": build(mt._conv1d_update_kernel, {"KERNEL": 4, "BLOCK_D": 128, "BLOCK_K": 4,
                                                          "HAS_BIAS": True, "HAS_MASK": True, "SILU": True}, "*bf16"),
        "scan_mamba2": build(mt._scan_varlen_kernel, {"BLOCK_P": 16, "BLOCK_N": 128, **flags}),
        "scan_mamba1": build(mt._scan_varlen_kernel, {"BLOCK_P": 128, "BLOCK_N": 16, **flags}, "*bf16"),
        "conv1d_varlen": build(mt._conv1d_varlen_kernel, {"KERNEL": 4, "BLOCK_D": 256, "HAS_BIAS": True,
                                                          "SILU": True}, "*bf16"),
    }


if __name__ == "__main__" and "--compile" in sys.argv:  # a child without TRITON_INTERPRET
    print(json.dumps(_compile_all()))
elif __name__ == "__main__":  # the child process: TRITON_INTERPRET=1 is set before triton is imported
    results: dict[str, Any] = {f"ssu_{name}": _ssu_case(**opts) for name, opts in CASES.items()}
    results.update({f"conv_{d}": _conv_case(d) for d in ("float32", "float16")})
    results.update({f"conv_varlen_{d}": _conv_varlen_case(d) for d in ("float32", "float16")})
    results["scan_mamba1_fp32"] = _scan_case("mamba1", "float32")
    results["scan_mamba1_fp16"] = _scan_case("mamba1", "float16")
    results["scan_mamba2_fp32"] = _scan_case("mamba2", "float32")
    print(json.dumps(results))
