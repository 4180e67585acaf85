"""The gated GEMM (plugins/quantization/unquantized/gated_gemm_kernel.py): act(x W_gate^T) * (x W_up^T) with the activation in the
epilogue, against the unfused path (the GEMM rounded to the dtype, then act_and_mul's rounding), under
Triton's CPU interpreter in a child process; the rule that sends a call to it; its sm_90 compile offline."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from interpreter_child import run_interpreted  # noqa: E402
from offline_compile import PTXAS_SM90A, compile_offline  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# name -> (M, K, I, dtype, activation, (bm, bn, bk, group_m, persistent)); relative L2 tolerance by dtype below
CASES: dict[str, tuple[int, int, int, str, str, tuple[int, int, int, int, bool]]] = {
    # a partial last row tile, 3 column tiles, a partial group of row tiles (grouped order, NOTE 2)
    "silu_fp32_tails": (70, 48, 48, "float32", "silu", (32, 16, 16, 2, False)),
    "silu_fp16": (64, 64, 32, "float16", "silu", (32, 16, 32, 8, False)),
    "gelu_tanh_fp16": (40, 32, 16, "float16", "gelu_tanh", (16, 16, 16, 1, False)),
    # K not a multiple of BK: the descriptor's zero fill past K
    "silu_fp32_k_tail": (33, 40, 32, "float32", "silu", (16, 32, 16, 4, False)),
    # persistent (NOTE 3): 3 programs over 9 tiles (3 each, the last group partial), and over fewer tiles
    "persistent_fp32": (70, 48, 48, "float32", "silu", (32, 16, 16, 2, True)),
    "persistent_fp16_few_tiles": (20, 32, 32, "float16", "silu", (16, 32, 16, 8, True)),
}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _reference(x: torch.Tensor, w: torch.Tensor, activation: str) -> torch.Tensor:
    """The unfused path's values: gate_up rounded to the dtype, act in float32 rounded, times up, rounded."""
    half = w.shape[0] // 2
    gu = (x.double() @ w.double().T).to(x.dtype).float()
    gate, up = gu[:, :half], gu[:, half:]
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    return (act.to(x.dtype).float() * up).to(x.dtype)


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    return dict(run_interpreted(__file__, timeout=400))


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_unfused_path(interp: dict[str, Any], case: str) -> None:
    got = interp[case]
    assert got["nan"] == 0 and got["rel"] < TOLERANCE[CASES[case][3]], got


def test_rule_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why a call cannot take the kernel; the per-layer switch from the engine config (env PAGEDLLM_GATED_GEMM
    is the config key's override); off it the method declines before looking."""
    from pagedllm.config import EngineConfig
    from pagedllm.plugins.quantization.unquantized.gated_gemm import maybe_gated_gemm, unusable_reason
    from pagedllm.plugins.quantization.unquantized.method import UnquantizedConfig

    x, w = torch.randn(4096, 64), torch.randn(256, 64)
    assert unusable_reason(x, w, None, "relu") == "activation 'relu'"
    assert unusable_reason(x, w, torch.zeros(256), "silu") == "bias"
    assert unusable_reason(x, w, None, "silu") == "needs CUDA sm_90+ (TMA)"
    assert maybe_gated_gemm(x, w, None, "silu") is None  # the CPU keeps the unfused path
    assert EngineConfig().gated_gemm is False
    monkeypatch.setenv("PAGEDLLM_GATED_GEMM", "true")
    assert EngineConfig.from_dict({}).gated_gemm is True

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.register_parameter("bias", None)
    off = UnquantizedConfig.from_config({"gated_gemm": False}).get_method(layer, "mlp.gate_up_proj")
    on = UnquantizedConfig.from_config({"gated_gemm": True}).get_method(layer, "mlp.gate_up_proj")
    assert not off.gated_gemm and off.apply_act_and_mul(layer, x, "silu") is None
    assert on.gated_gemm
    assert on.apply_act_and_mul(layer, x, "silu") is None  # on, but the CPU declines


def test_default_config_compiles_for_sm90() -> None:
    """DEFAULT_CONFIG, plain and persistent, and the warp-specialized 128 x 128 x 64 tile (NOTE 4) through
    Triton's sm_90 compiler: tensor-core wgmma, TMA loads, shared memory within an SM's 227 KB, no spills in
    ptxas for sm_90a."""
    code = PTXAS_SM90A + (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.plugins.quantization.unquantized.gated_gemm import DEFAULT_CONFIG, GatedGemmConfig\n"
        "from pagedllm.plugins.quantization.unquantized import gated_gemm_kernel as g\n"
        "ws = GatedGemmConfig(128, 128, 64, 8, 3, warp_specialize=True)\n"
        "for c, fn, extra in ((DEFAULT_CONFIG, g._gated_gemm_kernel, {'WARP_SPECIALIZE': False}),\n"
        "                     (DEFAULT_CONFIG, g._gated_gemm_persistent_kernel, {'NUM_PROGRAMS': 132}),\n"
        "                     (ws, g._gated_gemm_kernel, {'WARP_SPECIALIZE': True})):\n"
        "    sig = {'a_desc': f'tensordesc<bf16[{c.bm},{c.bk}]>', 'w_desc': f'tensordesc<bf16[{c.bn},{c.bk}]>',\n"
        "           'c_desc': f'tensordesc<bf16[{c.bm},{c.bn}]>', 'M': 'i32', 'HALF': 'i32', 'K': 'i32'}\n"
        "    cons = dict(BM=c.bm, BN=c.bn, BK=c.bk, GROUP_M=c.group_m, GELU_TANH=False, **extra)\n"
        "    sig.update({k: 'constexpr' for k in cons})\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys), target=GPUTarget('cuda', 90, 32),\n"
        "                       options={'num_warps': c.num_warps, 'num_stages': c.num_stages})\n"
        "    ptx = k.asm['ptx']\n"
        "    assert 'wgmma.mma_async' in ptx and 'cp.async.bulk.tensor' in ptx\n"
        "    assert k.metadata.shared <= 227 * 1024, k.metadata.shared\n"
        "    print(fn.__name__, ptxas_sm90a(k), k.metadata.shared)\n"
        "print('ok')\n"
    )
    compile_offline(code)


def _main() -> None:
    """Child: every case under the interpreter, one JSON line."""
    import json

    from pagedllm.plugins.quantization.unquantized.gated_gemm import GatedGemmConfig
    from pagedllm.plugins.quantization.unquantized.gated_gemm_kernel import gated_gemm

    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    results = {}
    gen = torch.Generator().manual_seed(0)
    for name, (m, k, half, dtype, activation, (bm, bn, bk, group, persistent)) in CASES.items():
        dt = getattr(torch, dtype)
        x = torch.randn(m, k, generator=gen).to(dt)
        w = (torch.randn(2 * half, k, generator=gen) * 0.25).to(dt)
        cfg = GatedGemmConfig(bm, bn, bk, num_warps=4, num_stages=2, group_m=group, persistent=persistent)
        got = gated_gemm(x, w, activation, cfg)
        ref = _reference(x, w, activation)
        results[name] = {"nan": int(torch.isnan(got).sum()),
                         "rel": float((got.float() - ref.float()).norm() / ref.float().norm())}
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
