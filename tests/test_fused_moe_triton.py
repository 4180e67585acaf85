"""The fused-MoE Triton kernels (core/layers/fused_moe_triton.py, moe_align.py) on the CPU.

The kernels run under Triton's interpreter in one child process (this file as a script: TRITON_INTERPRET must
be set before triton is imported; tests/interpreter_child.py), on tiny shapes in float32 and float16 (bfloat16
arithmetic is not faithful in the interpreter). Each case is compared with a per-(token, k) loop written
here in float64 -- the definition, nothing shared with the kernel -- and with the torch reference
pagedllm.layers.moe_reference.fused_moe_reference. The alignment is checked against its invariants on
random routings (every pair exactly once, in its expert's run, in flat order; padding; block experts). The
argument checks, the config table and an offline sm_90 compile (tl.dot for Hopper, no GPU) run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from typing import Any

import pytest
import torch
from interpreter_child import run_interpreted
from offline_compile import compile_offline

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# name -> (T, E, K, options). Options: dtype, bias, activation, limit / alpha, route ("all", "half": only the
# first E // 2 experts get tokens, "one": every token's first choice is expert 0), tiles (block_m, block_n,
# block_k) or None for the default table, H / I.
KERNEL_CASES: dict[str, tuple[int, int, int, dict[str, Any]]] = {
    "t1_k1_e4": (1, 4, 1, {}),
    "t1_k4_e8_bias": (1, 8, 4, {"bias": True}),
    "t3_k2_e4_fp16": (3, 4, 2, {"dtype": "float16"}),
    "t17_k2_e8_half_routed": (17, 8, 2, {"route": "half"}),
    "t17_k3_e6_bias_fp16": (17, 6, 3, {"bias": True, "dtype": "float16"}),
    "t40_k2_e4_one_expert_hot": (40, 4, 2, {"route": "one"}),  # expert 0: 40 rows -> 3 blocks of 16
    "t40_k2_e4_5chunks": (40, 4, 2, {"route": "one", "one_hot": 64}),  # alignment over 5 programs
    "t23_k4_e8_swiglu": (23, 8, 4, {"activation": "swigluoai", "limit": 0.6, "alpha": 1.702, "bias": True}),
    "t23_k4_e8_swiglu_fp16": (23, 8, 4, {"activation": "swigluoai", "limit": 0.6, "alpha": 1.702, "bias": True,
                                          "dtype": "float16"}),
    "t9_k2_e5_swiglu_defaults": (9, 5, 2, {"activation": "swigluoai", "scale": 6.0}),  # limit 7.0 must bite
    "t12_k2_e4_gelu": (12, 4, 2, {"activation": "gelu", "bias": True}),
    "t30_k3_e7_block32": (30, 7, 3, {"tiles": (32, 64, 32), "route": "half"}),
    "t30_k3_e7_down16_group4": (30, 7, 3, {"tiles": (16, 64, 32), "down_block_n": 16, "group_m": 4}),
    "t2_k2_e8_default_table": (2, 8, 2, {"tiles": None, "bias": True}),  # 16 x 128 x 128 tiles, masked tails
    "t64_k2_e4_default_table_fp16": (64, 4, 2, {"tiles": None, "dtype": "float16"}),  # the 32-row config
    "t5_k4_e4_every_expert": (5, 4, 4, {"activation": "swigluoai", "limit": 1.0, "alpha": 1.0}),  # K = E
}
# And random draws of everything above (seeded, so a failure names a reproducible case).
_draw = random.Random(28)
for _n in range(4):
    _k, _act = _draw.randint(1, 4), _draw.choice(["silu", "gelu", "swigluoai"])
    KERNEL_CASES[f"random{_n}"] = (_draw.randint(1, 33), _draw.randint(max(4, _k), 8), _k, {
        "dtype": _draw.choice(["float32", "float16"]), "bias": _draw.random() < 0.5, "activation": _act,
        "route": _draw.choice(["all", "half", "one"]) if _k <= 2 else "all",
        **({"limit": 0.8, "alpha": 1.702} if _act == "swigluoai" else {})})
# max |got - ref| / max |ref| against the float64 loop; the kernel rounds act and the per-k outputs to the
# input dtype once each (fused_moe_triton NOTE 3).
TOL = {"float32": 2e-6, "float16": 4e-3}
# name -> (T, K, E, block_m, one-hot budget): alignment on random routings. The budget (moe_align's
# _ONE_HOT_ELEMENTS, chunk = budget / next_power_of_2(E) pairs, at least 16) is lowered so that small routings
# span several programs and the cursors carried across them are checked; E = 300 takes 16-pair chunks as is.
ALIGN_CASES = {
    "t1_k1_e4_bm16": (1, 1, 4, 16, None),
    "t1_k4_e8_bm16": (1, 4, 8, 16, None),
    "t37_k2_e8_bm16": (37, 2, 8, 16, None),
    "t64_k4_e6_bm32": (64, 4, 6, 32, None),
    "t37_k2_e8_bm16_3chunks": (37, 2, 8, 16, 256),
    "t64_k4_e6_bm32_16chunks": (64, 4, 6, 32, 128),
    "t10_k4_e300_bm16_3chunks": (10, 4, 300, 16, None),
}


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    return run_interpreted(__file__, timeout=400)  # ~25 s of CPU; the 2 cores are shared


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_against_loop_and_reference(interp: dict[str, Any], case: str) -> None:
    res = interp["kernel"][case]
    tol = TOL[KERNEL_CASES[case][3].get("dtype", "float32")]
    assert res["shape_ok"] and res["dtype_ok"] and res["finite"], res
    assert res["rel_loop"] < tol, res
    assert res["rel_reference"] < 2 * tol, res  # the reference rounds after every op in the input dtype
    if "limit" in KERNEL_CASES[case][3] or "scale" in KERNEL_CASES[case][3]:
        assert res["clamped"] > 0.05, res  # the clamp changed many gates: the case tests it


def test_kernel_ignores_nothing(interp: dict[str, Any]) -> None:
    """Each input moves the output where it must: dropping a bias, the clamp or a routing weight is caught
    (the loop's answer without it is far from the kernel's), and zero tokens give an empty [0, H]."""
    res = interp["sensitivity"]
    assert res["without_bias"] > 1e-2 and res["without_clamp"] > 1e-2 and res["weights_swapped"] > 1e-2, res
    assert res["empty_shape"] == [0, 40], res


@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_align_invariants(interp: dict[str, Any], case: str) -> None:
    res = interp["align"][case]
    chunks = int(case.rsplit("_", 1)[1].removesuffix("chunks")) if case.endswith("chunks") else 1
    assert res == {"ok": True, "trials": 8, "chunks": chunks}, res


def test_default_table_and_override() -> None:
    from pagedllm.layers.moe_kernel_config import DEFAULT_TABLE, MoeKernelConfig, config_for, override_config

    # BLOCK_M: the largest power of two at most twice the mean rows per expert, within 16..128.
    assert config_for(1, 2, 8).block_m == 16  # decode: 0.25 rows an expert
    assert config_for(64, 4, 32).block_m == 16  # gpt-oss-20b at 64 tokens: 8 rows an expert
    assert config_for(64, 2, 8).block_m == 32  # Mixtral at 64 tokens: 16 rows an expert
    assert config_for(256, 6, 64).block_m == 32  # DeepSeek-V2-Lite at 256 tokens: 24 rows an expert
    assert config_for(128, 2, 8).block_m == 64  # 32 rows an expert
    assert config_for(4096, 2, 8) == DEFAULT_TABLE[128]
    assert all(block_m == cfg.block_m for block_m, cfg in DEFAULT_TABLE.items())
    forced = MoeKernelConfig(64, 64, 32, group_m=4, num_warps=4, num_stages=2)
    with override_config(forced):
        assert config_for(1, 2, 8) == forced and config_for(4096, 2, 8) == forced
    assert config_for(1, 2, 8) != forced  # restored on exit
    for bad in ({"block_m": 8, "block_n": 64, "block_k": 32}, {"block_m": 16, "block_n": 16, "block_k": 32},
                {"block_m": 16, "block_n": 96, "block_k": 32},
                {"block_m": 16, "block_n": 64, "block_k": 32, "down_block_n": 8}):
        with pytest.raises(ValueError, match="power of two"):
            MoeKernelConfig(**bad)
    with pytest.raises(TypeError), override_config({"block_m": 16}):  # type: ignore[arg-type]
        pass


def _args(**change: Any) -> dict[str, Any]:
    t, h, i, e, k = 3, 16, 8, 4, 2
    args: dict[str, Any] = {
        "hidden": torch.randn(t, h), "w13": torch.randn(e, 2 * i, h), "w2": torch.randn(e, h, i),
        "topk_weights": torch.rand(t, k), "topk_ids": torch.randint(0, e, (t, k), dtype=torch.int32),
    }
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    ({"activation": "relu"}, "activation 'relu'"),
    ({"swiglu_limit": 7.0}, "swigluoai"),  # with silu: an error, never ignored
    ({"topk_ids": torch.zeros(3, 2, dtype=torch.int64)}, "topk_ids must be int32"),
    ({"topk_weights": torch.rand(3, 2, dtype=torch.float16)}, "topk_weights must be float32"),
    ({"w2": torch.randn(4, 16, 8, dtype=torch.float16)}, "w2 is torch.float16"),
    ({"w13": torch.randn(4, 16, 16).transpose(1, 2)}, "w13 needs a unit last stride"),
    ({"w13_bias": torch.randn(4, 15)}, "w13_bias"),
    ({"topk_ids": torch.tensor([[0, 4], [1, 2], [3, 0]], dtype=torch.int32)}, r"topk_ids must be in \[0, 4\)"),
    ({"hidden": torch.randn(3, 16, dtype=torch.float64), "w13": torch.randn(4, 16, 16, dtype=torch.float64),
      "w2": torch.randn(4, 16, 8, dtype=torch.float64)}, "float16, bfloat16 or float32"),
])
def test_bad_arguments_name_the_field(change: dict[str, Any], match: str) -> None:
    from pagedllm.layers.fused_moe_triton import fused_moe

    with pytest.raises(ValueError, match=match):
        fused_moe(**_args(**change))


def test_kernels_compile_for_sm90() -> None:
    """Both grouped GEMMs in bfloat16 with the smallest and the largest default tile (swigluoai), the other
    activations, float32 with IEEE dots, and the two alignment kernels, through Triton's sm_90 compiler
    offline: tl.dot lowers to tensor-core MMA (wgmma for the large tile), the K loop is pipelined, and every
    tile's shared memory fits the H200's 227 KB."""
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from pagedllm.layers import fused_moe_triton as fm, moe_align as ma\n"
        "from pagedllm.layers.moe_kernel_config import DEFAULT_TABLE\n"
        "PTRS = {'x_ptr': '*bf16', 'w_ptr': '*bf16', 'bias_ptr': '*bf16', 'out_ptr': '*bf16', 'a_ptr': '*bf16',\n"
        "        'weights_ptr': '*fp32', 'sorted_ptr': '*i32', 'expert_ids_ptr': '*i32', 'total_ptr': '*i32',\n"
        "        'ids_ptr': '*i32', 'hist_ptr': '*i32'}\n"
        "def build(fn, cons, warps, stages):\n"
        "    sig = {a: 'constexpr' if a in cons else PTRS.get(a, 'fp32' if a in ('limit', 'alpha') else 'i32')\n"
        "           for a in fn.arg_names}\n"
        "    attrs = {(i,): [['tt.divisibility', 16]] for i, a in enumerate(fn.arg_names)\n"
        # N and K too: the model's sizes are multiples of 16, which Triton specializes on at launch (only
        # then is the masked K loop pipelined through cp.async, so only then is the shared memory real)
        "             if sig[a].startswith('*') or a.startswith('stride') or a in ('N', 'K')}\n"
        "    keys = {(fn.arg_names.index(k),): v for k, v in cons.items()}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=keys,\n"
        "                                 attrs=attrs), target=GPUTarget('cuda', 90, 32),\n"
        "                       options={'num_warps': warps, 'num_stages': stages})\n"
        "    assert k.metadata.shared <= 227 * 1024, k.metadata.shared\n"
        "    return k\n"
        "for cfg in (DEFAULT_TABLE[16], DEFAULT_TABLE[128]):\n"
        "    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,\n"
        "                 HAS_BIAS=True, DOT_PRECISION='tf32')\n"
        "    k1 = build(fm._gate_up_kernel, dict(tiles, TOP_K=4, ACT=2), cfg.num_warps, cfg.num_stages)\n"
        "    k2 = build(fm._down_kernel, tiles, cfg.num_warps, cfg.num_stages)\n"
        "    for k in (k1, k2):\n"
        "        assert 'wgmma' in k.asm['ptx'] or 'mma.sync' in k.asm['ptx'], 'no tensor-core MMA'\n"
        "    assert 'cp.async' in k1.asm['ptx'] and 'cp.async' in k2.asm['ptx'], 'K loop not pipelined'\n"
        "    print(cfg, k1.metadata.shared, k2.metadata.shared, 'wgmma' in k1.asm['ptx'])\n"
        "tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, HAS_BIAS=False, DOT_PRECISION='tf32')\n"
        "for act in (0, 1):  # silu, gelu (erf)\n"
        "    build(fm._gate_up_kernel, dict(tiles, TOP_K=2, ACT=act), 4, 2)\n"
        "PTRS.update({k: v.replace('bf16', 'fp32') for k, v in PTRS.items()})\n"
        "build(fm._down_kernel, dict(tiles, DOT_PRECISION='ieee'), 4, 2)  # float32 inputs\n"
        "build(ma._count_kernel, dict(E_PAD=32, CHUNK=256), 4, 1)\n"
        "build(ma._place_kernel, dict(E_PAD=32, CHUNK=256, BLOCK_M=16), 4, 1)\n"
        "print('ok')\n"
    )
    print(compile_offline(code))


BENCH = os.path.join(os.path.dirname(__file__), "..", "examples", "gpu", "bench_fused_moe.py")


def test_bench_script_cpu_parts(interp: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU benchmark's CPU-safe parts: --help, a bad --shapes named, and (in the interpreter child) its rows
    on one tiny shape each -- the problem, timing and error code of the GPU run, our kernel equal to the loop."""
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import bench_fused_moe as bench
    finally:
        sys.path.remove(os.path.dirname(BENCH))
    with pytest.raises(SystemExit) as done:
        bench.main(["--help"])
    assert done.value.code == 0 and "--vllm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        bench.main(["--dry-run", "--shapes", "mixtral,llama"])
    assert done.value.code == 2 and "--shapes: unknown ['llama']" in capsys.readouterr().err
    rows = interp["bench"]
    assert [(r["shape"], r["tokens"]) for r in rows] == [("mixtral", 1), ("gpt-oss-20b", 3)], rows
    assert all(r["ours"]["err"] < 1e-5 and r["ours"]["eager_us"] > 0 and r["loop"]["eager_us"] > 0
               for r in rows), rows
    assert "config" not in rows[0] and rows[1]["config"]["down_block_n"] == 16, rows


# -- the interpreter child -------------------------------------------------------------------------------------


def _loop_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, activation: str, b13: torch.Tensor | None, b2: torch.Tensor | None,
                    limit: float | None, alpha: float | None) -> tuple[torch.Tensor, float]:
    """The definition, one (token, k) at a time in float64; also the share of gate values the clamp moved."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    clamped = total = 0
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t] + (b13[e].double() if b13 is not None else 0.0)
            gate, up = h[:inter], h[inter:]
            if activation == "silu":
                act = gate * torch.sigmoid(gate) * up
            elif activation == "gelu":
                act = 0.5 * gate * (1 + torch.erf(gate / 2 ** 0.5)) * up
            else:
                lim = 7.0 if limit is None else limit
                a = 1.702 if alpha is None else alpha
                clamped += int((gate > lim).sum())
                total += inter
                gate = torch.minimum(gate, torch.tensor(lim, dtype=torch.float64))
                up = up.clamp(-lim, lim)
                act = (up + 1) * gate * torch.sigmoid(a * gate)
            y = w2[e] @ act + (b2[e].double() if b2 is not None else 0.0)
            out[t] += float(weights[t, k]) * y
    return out, clamped / max(1, total)


def _routing(tokens: int, experts: int, top_k: int, route: str, gen: torch.Generator) -> torch.Tensor:
    pool = experts // 2 if route == "half" else experts
    rows = []
    for _ in range(tokens):
        pick = torch.randperm(pool, generator=gen)[:top_k] if top_k <= pool else torch.randperm(experts,
                                                                                               generator=gen)[:top_k]
        if route == "one" and 0 not in pick.tolist():
            pick[0] = 0
        rows.append(pick)
    return torch.stack(rows).to(torch.int32)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _kernel_case(seed: int, tokens: int, experts: int, top_k: int, dtype: str = "float32", bias: bool = False,
                 activation: str = "silu", limit: float | None = None, alpha: float | None = None,
                 route: str = "all", tiles: tuple[int, int, int] | None = (16, 32, 16), hidden: int = 40,
                 inter: int = 24, scale: float = 1.0, one_hot: int | None = None, down_block_n: int | None = None,
                 group_m: int = 1) -> dict[str, Any]:
    from pagedllm.layers import moe_align
    from pagedllm.layers.fused_moe_triton import fused_moe
    from pagedllm.layers.moe_kernel_config import MoeKernelConfig, override_config
    from pagedllm.layers.moe_reference import fused_moe_reference

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    # H = 40 and I = 24 are not multiples of the 16 / 32 tiles: every K loop and column block has a tail.
    x = (scale * torch.randn(tokens, hidden, generator=gen)).to(dt)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dt)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dt)
    b13 = (0.5 * torch.randn(experts, 2 * inter, generator=gen)).to(dt) if bias else None
    b2 = (0.5 * torch.randn(experts, hidden, generator=gen)).to(dt) if bias else None
    ids = _routing(tokens, experts, top_k, route, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    extra: dict[str, Any] = {"activation": activation, "w13_bias": b13, "w2_bias": b2}
    if activation == "swigluoai":
        extra.update(swiglu_limit=limit, swiglu_alpha=alpha)
    budget = moe_align._ONE_HOT_ELEMENTS
    moe_align._ONE_HOT_ELEMENTS = one_hot or budget
    try:
        if tiles is None:
            got = fused_moe(x, w13, w2, weights, ids, **extra)
        else:
            with override_config(MoeKernelConfig(*tiles, group_m=group_m, down_block_n=down_block_n)):
                got = fused_moe(x, w13, w2, weights, ids, **extra)
    finally:
        moe_align._ONE_HOT_ELEMENTS = budget
    ref, clamped = _loop_reference(x, w13, w2, weights, ids, activation, b13, b2, limit, alpha)
    reference = fused_moe_reference(x, w13, w2, weights, ids, **extra)
    return {"rel_loop": _rel(got, ref), "rel_reference": _rel(got, reference.double()),
            "shape_ok": list(got.shape) == [tokens, hidden], "dtype_ok": got.dtype == dt,
            "finite": bool(torch.isfinite(got).all()), "clamped": clamped}


def _sensitivity_case() -> dict[str, Any]:
    """The kernel's answer against loops that drop one input: each must be far off (so the tolerances above
    could fail for a kernel that forgot it)."""
    from pagedllm.layers.fused_moe_triton import fused_moe
    from pagedllm.layers.moe_kernel_config import MoeKernelConfig, override_config

    gen = torch.Generator().manual_seed(7)
    t, h, i, e, k = 11, 40, 24, 6, 2
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    b13, b2 = 0.5 * torch.randn(e, 2 * i, generator=gen), 0.5 * torch.randn(e, h, generator=gen)
    ids = _routing(t, e, k, "all", gen)
    weights = torch.rand(t, k, generator=gen)
    with override_config(MoeKernelConfig(16, 32, 16)):
        got = fused_moe(x, w13, w2, weights, ids, "swigluoai", b13, b2, 0.5, 1.702)
        empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0], "silu")
    no_bias, _ = _loop_reference(x, w13, w2, weights, ids, "swigluoai", None, None, 0.5, 1.702)
    no_clamp, _ = _loop_reference(x, w13, w2, weights, ids, "swigluoai", b13, b2, 1e9, 1.702)
    swapped, _ = _loop_reference(x, w13, w2, weights.flip(1), ids, "swigluoai", b13, b2, 0.5, 1.702)
    return {"without_bias": _rel(got, no_bias), "without_clamp": _rel(got, no_clamp),
            "weights_swapped": _rel(got, swapped), "empty_shape": list(empty.shape)}


def _align_ok(ids: torch.Tensor, experts: int, block_m: int) -> bool:
    from pagedllm.layers.moe_align import max_slots, moe_align_block_size

    sorted_ids, expert_ids, total_t = moe_align_block_size(ids, block_m, experts)
    flat = ids.reshape(-1).tolist()
    numel = len(flat)
    total = int(total_t[0])
    counts = [flat.count(x) for x in range(experts)]
    padded = [-(-c // block_m) * block_m for c in counts]
    if sorted_ids.numel() != max_slots(numel, block_m, experts) or total != sum(padded):
        return False
    slots, start = sorted_ids.tolist(), 0
    for expert, (count, pad) in enumerate(zip(counts, padded, strict=True)):
        run = slots[start:start + pad]
        # this expert's pairs in flat order, then the padding sentinel; its blocks name it
        if run != [p for p, x in enumerate(flat) if x == expert] + [numel] * (pad - count):
            return False
        if expert_ids[start // block_m:(start + pad) // block_m].tolist() != [expert] * (pad // block_m):
            return False
        start += pad
    return all(s == numel for s in slots[total:]) and all(b == -1 for b in expert_ids[total // block_m:].tolist())


def _align_case(tokens: int, top_k: int, experts: int, block_m: int, one_hot: int | None) -> dict[str, Any]:
    from pagedllm.layers import moe_align

    rng = random.Random(tokens * 1000 + experts)
    budget = moe_align._ONE_HOT_ELEMENTS
    moe_align._ONE_HOT_ELEMENTS = one_hot or budget
    try:
        chunk = max(16, min(1024, moe_align._ONE_HOT_ELEMENTS // (1 << (experts - 1).bit_length())))
        return {**_align_trials(rng, tokens, top_k, experts, block_m), "chunks": -(-tokens * top_k // chunk)}
    finally:
        moe_align._ONE_HOT_ELEMENTS = budget


def _align_trials(rng: random.Random, tokens: int, top_k: int, experts: int, block_m: int) -> dict[str, Any]:
    trials = 0
    for trial in range(8):
        # uniform, then skewed (a few hot experts), then every pair on one expert; always distinct per token
        hot = experts if trial % 3 == 0 else max(top_k, min(experts, 1 + trial)) if trial % 3 == 1 else top_k
        rows = [rng.sample(range(hot), top_k) for _ in range(tokens)]
        if not _align_ok(torch.tensor(rows, dtype=torch.int32), experts, block_m):
            return {"ok": False, "trial": trial, "rows": rows[:4]}
        trials += 1
    return {"ok": True, "trials": trials}


def _main() -> None:
    """Child process: every case under the interpreter, one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    results: dict[str, Any] = {"kernel": {}, "align": {}}
    for seed, (name, (tokens, experts, top_k, opts)) in enumerate(KERNEL_CASES.items()):
        results["kernel"][name] = _kernel_case(seed, tokens, experts, top_k, **opts)
    results["sensitivity"] = _sensitivity_case()
    for name, (tokens, top_k, experts, block_m, one_hot) in ALIGN_CASES.items():
        results["align"][name] = _align_case(tokens, top_k, experts, block_m, one_hot)
    sys.path.insert(0, os.path.dirname(BENCH))
    import bench_fused_moe as bench

    from pagedllm.layers.moe_kernel_config import MoeKernelConfig

    forced = MoeKernelConfig(16, 64, 32, down_block_n=16)  # the gpt-oss row through --config's path
    results["bench"] = [row for shape, t, cfg in (("mixtral", 1, None), ("gpt-oss-20b", 3, forced))
                        for row in bench.run_rows([bench.DRY_SHAPES[shape]], [t], 1, torch.float32, "cpu", 1,
                                                  with_vllm=False, with_ours=True, config=cfg)]
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
