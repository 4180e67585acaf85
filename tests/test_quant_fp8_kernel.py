"""The fused per-token FP8 activation quantization (fp8/kernel.py) against the torch code, under Triton's interpreter.

Bit for bit: x_q's bytes and the float32 scales must equal fp8_method.quantize_activations_torch's. The
rows include the cases a cast gets wrong when done carelessly: ties (x / a exactly halfway between two e4m3
values), rounding that carries into the next power of two, subnormal results, -0.0, an all-zero row (the
1e-12 scale floor) and a row whose scaled values reach +-448. TRITON_INTERPRET must be set before triton is
first imported, so the cases run in one child process (this file as a script).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
from interpreter_child import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# (name, dtype, K, static scale or None, max_single_pass)
CASES = [
    ("dynamic_fp32", "float32", 300, None, 16384),
    ("dynamic_fp16", "float16", 300, None, 16384),
    ("dynamic_fp32_two_pass", "float32", 300, None, 64),
    ("static_fp16", "float16", 300, 0.0137, 16384),
    ("static_fp32_two_pass", "float32", 300, 0.5, 128),
]


def _rows(k: int) -> Any:
    """[8, k] float64 rows: random scales of random data, plus the hand-made edge rows described above."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, k, generator=g, dtype=torch.float64) * torch.tensor([1e-3, 0.1, 1, 10, 300, 1, 1, 1]).unsqueeze(1)
    # Row 5: max 448 -> scale 1.0, then ties between e4m3 neighbours (step 1/16 in [0.5, 1), 1/512 subnormal),
    # a value that rounds up across a power of two, subnormals, signed zeros.
    edge = [448.0, 0.53125, 0.59375, -0.53125, 0.96875, 0.4927, 0.0009765625, 0.0029296875, -0.0, 0.0, -448.0,
            1e-6, -1e-6, 240.0, 232.0, 248.0]
    x[5, : len(edge)] = torch.tensor(edge, dtype=torch.float64)
    x[6] = 0.0  # all-zero row: the 1e-12 scale floor
    x[7, ::3] = -0.0
    return x


def _run() -> dict[str, Any]:
    import torch

    from pagedllm.plugins.quantization.fp8.kernel import quantize_per_token
    from pagedllm.plugins.quantization.fp8.method import quantize_activations_torch

    results: dict[str, Any] = {}
    for name, dtype_name, k, static, max_single in CASES:
        x = _rows(k).to(getattr(torch, dtype_name))
        scale = None if static is None else torch.tensor([[static]], dtype=torch.float32)
        q, a = quantize_per_token(x, scale, max_single_pass=max_single)
        q_ref, a_ref = quantize_activations_torch(x, scale)
        diff = (q.view(torch.uint8) != q_ref.view(torch.uint8))
        results[name] = {
            "shapes": [list(q.shape), list(a.shape)], "dtypes": [str(q.dtype), str(a.dtype)],
            "bytes_differ": int(diff.sum()),
            "first_differ": [float(v) for v in x[diff][:4].float()],
            "scales_equal": bool(torch.equal(a, a_ref)),
            "nonzero_codes": int((q_ref.view(torch.uint8) & 0x7F != 0).sum()),
        }
    return results


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, Any]:
    return dict(run_interpreted(__file__))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_quantization_equals_torch(case: tuple[Any, ...], kernel_results: dict[str, Any]) -> None:
    name, _, k = case[0], case[1], case[2]
    got = kernel_results[name]
    assert got["shapes"] == [[8, k], [8, 1]]
    assert got["dtypes"] == ["torch.float8_e4m3fn", "torch.float32"]
    assert got["nonzero_codes"] > 5 * k  # the rows exercise real codes, not a sea of zeros
    assert got["bytes_differ"] == 0 and got["scales_equal"], got


if __name__ == "__main__":
    print(json.dumps(_run()))
