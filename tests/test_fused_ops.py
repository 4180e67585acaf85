"""Fused Triton norm / rotary / activation kernels against transformers and torch, in Triton's interpreter.

As in test_triton_attention.py, TRITON_INTERPRET must be set before `triton` is first imported, so every
kernel case runs in ONE child process (this file run as a script) started with TRITON_INTERPRET=1; the tests
read its JSON line. The references are code nobody here wrote: transformers' LlamaRMSNorm / GemmaRMSNorm,
Llama's and GPT-J's apply_rotary_pos_emb with GPT-J's sinusoid table, torch's silu / gelu(tanh).
Shapes are small and odd (row counts 1, 5, 7, 13; hidden sizes that are not powers of two; partial rotary;
q/k as strided views into a fused qkv row); fp32 and fp16 (the interpreter's bf16 math is not the GPU's:
examples/gpu/h200_check.py checks bf16 on the H200). The child also runs two tiny models end to end with
every fused op forced on and compares greedy tokens and log-probs with transformers.
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

from pagedllm.config import EngineConfig
from pagedllm.layers.fused_ops import set_fused_ops, use_fused

DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Max |got - ref| / max |ref| per dtype: fp32 agrees to float32 rounding (sums in another order);
# fp16 to one or two half ulps (the kernels round where the references round).
TOL = {"float32": 2e-6, "float16": 1e-3}
# fp16 share of elements allowed to differ from the reference at all. The norm and SiLU kernels round at the
# reference's rounding points (triton_ops NOTE 1), so they match bit for bit; GELU's tanh written as a
# sigmoid moves ~1 % of roundings. A kernel that rounds once too few or too many times differs in ~20 %.
MAX_DIFFER = 0.05

NORM_CASES = {  # name -> (rows, hidden, with residual, gemma)
    "rows7_h100": (7, 100, False, False),
    "rows7_h100_residual": (7, 100, True, False),
    "rows1_h256_residual": (1, 256, True, False),
    "rows13_h96_gemma": (13, 96, False, True),
    "rows5_h160_gemma_residual": (5, 160, True, True),
}
ROPE_CASES = {  # name -> (tokens, q heads, kv heads, head, rotary dim, neox)
    "neox_full": (5, 4, 2, 32, 32, True),
    "neox_partial": (7, 3, 1, 24, 16, True),
    "gptj_full": (5, 4, 2, 16, 16, False),
    "gptj_partial": (3, 6, 3, 40, 24, False),
}
ACT_CASES = {  # name -> (rows, d, activation); d 1500 spans two 1024-column tiles
    "silu_rows7_d37": (7, 37, "silu"),
    "silu_rows1_d1500": (1, 1500, "silu"),
    "gelu_rows5_d37": (5, 37, "gelu_tanh"),
    "gelu_rows3_d1500": (3, 1500, "gelu_tanh"),
}
ENGINE_MODELS = ("llama", "qwen3")  # qwen3: per-head q/k norm on strided [T, heads, head] views


@pytest.fixture(scope="module")
def interp() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(NORM_CASES))
def test_rms_norm_kernel(interp: dict[str, Any], case: str, dtype: str) -> None:
    res = interp["norm"][f"{case}_{dtype}"]
    assert res["out_err"] < TOL[dtype], res
    if dtype == "float16":
        assert res["differ"] < MAX_DIFFER, res
    if NORM_CASES[case][2]:
        assert res["residual_equal"], "residual_out must be exactly x + residual in the model dtype"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rms_norm_kernel_strided_heads(interp: dict[str, Any], dtype: str) -> None:
    """Qwen3's q_norm input: [T, heads, head] views into a qkv row, normalised per head without a copy."""
    res = interp["norm"][f"strided_heads_{dtype}"]
    assert res["out_err"] < TOL[dtype], res
    assert res["source_untouched"]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_kernel(interp: dict[str, Any], case: str, dtype: str) -> None:
    res = interp["rope"][f"{case}_{dtype}"]
    assert res["q_err"] < TOL[dtype] and res["k_err"] < TOL[dtype], res
    assert res["pass_through_equal"], "dims past rotary_dim and the v part of qkv must not change"
    assert res["in_place"], "q and k are rotated in place and returned"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(ACT_CASES))
def test_act_and_mul_kernel(interp: dict[str, Any], case: str, dtype: str) -> None:
    res = interp["act"][f"{case}_{dtype}"]
    assert res["err"] < TOL[dtype], res
    if dtype == "float16":
        assert res["differ"] < MAX_DIFFER, res
    assert res["shape_ok"]


def test_layers_dispatch_to_the_kernels(interp: dict[str, Any]) -> None:
    """Each layer with fused_mode 'always' (kernel) equals itself with 'off' (torch), same return shapes."""
    res = interp["layers"]
    assert res["calls"] == {"rms_norm": 3, "rotary_embedding": 2, "act_and_mul": 2}, res
    for name, err in res["errors"].items():
        assert err < TOL["float32"], (name, err)


@pytest.mark.parametrize("kind", ENGINE_MODELS)
def test_engine_with_fused_ops_matches_transformers(interp: dict[str, Any], kind: str) -> None:
    res = interp["engine"][kind]
    assert res["fused_modules"] > 0
    assert res["tokens_equal"], res
    assert res["max_delta_logprob"] < 1e-4, res


def test_cpu_auto_mode_keeps_torch_path() -> None:
    """On the CPU 'auto' never runs a kernel (the parity tests' torch path is untouched), 'always' needs the
    interpreter and says so, and an unknown mode names itself."""
    from pagedllm.layers.norm import RMSNorm

    norm = RMSNorm(8)
    x = torch.randn(3, 8)
    assert norm.fused_mode == "auto" and not use_fused(norm, x)
    set_fused_ops(norm, "always")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            norm(x)
    with pytest.raises(ValueError, match="'fast'"):
        set_fused_ops(norm, "fast")  # type: ignore[arg-type]


def test_switch_from_config_and_environment(tiny_root: Any) -> None:
    from tiny_models import make_tiny_model

    from pagedllm import LLM
    from pagedllm.layers.fused_ops import FusedOp

    assert EngineConfig.from_dict({}, env={}).fused_ops is True
    assert EngineConfig.from_dict({}, env={"PAGEDLLM_FUSED_OPS": "false"}).fused_ops is False
    llm = LLM(make_tiny_model("llama", tiny_root), fused_ops=False, num_kv_blocks=16)
    modes = {m.fused_mode for m in llm.engine.parts.model.modules() if isinstance(m, FusedOp)}
    llm.shutdown()
    assert modes == {"off"}


def test_gptj_torch_path_matches_transformers() -> None:
    """The torch code of the interleaved (GPT-J) style, which the kernel is checked against above too."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    from pagedllm.layers.rotary import RotaryEmbedding

    tokens, heads, head, rot = 6, 3, 20, 12
    rope = RotaryEmbedding(head, rot, 64, 10000.0, is_neox_style=False)
    positions = torch.tensor([0, 9, 3, 63, 1, 30])
    q, k = torch.randn(tokens, heads * head), torch.randn(tokens, heads * head)
    got_q, _ = rope(positions, q, k)
    table = create_sinusoidal_positions(64, rot)[positions][None]  # [1, T, rot]: sin | cos
    sin, cos = table[..., : rot // 2], table[..., rot // 2 :]
    x = q.view(1, tokens, heads, head)
    ref = torch.cat((apply_rotary_pos_emb(x[..., :rot], sin, cos), x[..., rot:]), dim=-1)
    torch.testing.assert_close(got_q.view(1, tokens, heads, head), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ child process
def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _differ(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Share of elements not bit-equal to the reference."""
    return float((got != ref).float().mean())


def _norm_cases(gen: torch.Generator) -> dict[str, Any]:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from pagedllm.layers.triton_ops import rms_norm

    out: dict[str, Any] = {}
    for dname, dt in DTYPES.items():
        for name, (rows, hidden, with_res, gemma) in NORM_CASES.items():
            ref_norm = (HFGemmaRMSNorm if gemma else LlamaRMSNorm)(hidden, eps=1e-5)
            with torch.no_grad():
                ref_norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0.0 if gemma else 1.0))
            ref_norm.to(dt)
            x = (torch.randn(rows, hidden, generator=gen) * 3).to(dt)
            res = torch.randn(rows, hidden, generator=gen).to(dt) if with_res else None
            stream = x + res if res is not None else x
            with torch.no_grad():
                ref = ref_norm(stream)
            got, got_res = rms_norm(x, ref_norm.weight.detach(), 1e-5, res, gemma=gemma)
            out[f"{name}_{dname}"] = {
                "out_err": _err(got, ref),
                "differ": _differ(got, ref),
                "residual_equal": got_res is not None and bool(torch.equal(got_res, stream)),
            }
        # Qwen3: q = qkv[:, :H * D] viewed as [T, H, D], strides (qkv width, D, 1).
        tokens, heads, head = 5, 3, 24
        qkv = torch.randn(tokens, heads * head + 40, generator=gen).to(dt)
        before = qkv.clone()
        view = qkv[:, : heads * head].view(tokens, heads, head)
        ref_norm = LlamaRMSNorm(head, eps=1e-6)
        with torch.no_grad():
            ref_norm.weight.copy_(torch.rand(head, generator=gen) + 0.5)
            ref_norm.to(dt)
            ref = ref_norm(view)
        got, _ = rms_norm(view, ref_norm.weight.detach(), 1e-6)
        out[f"strided_heads_{dname}"] = {
            "out_err": _err(got, ref) if got.shape == ref.shape else 1.0,
            "source_untouched": bool(torch.equal(qkv, before)),
        }
    return out


def _rope_reference(
    x: torch.Tensor, positions: torch.Tensor, heads: int, head: int, rot: int, neox: bool, base: float
) -> torch.Tensor:
    """transformers' own rotation of x [T, heads * head] (float32 math on the given dtype's values)."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply

    tokens = x.shape[0]
    x4 = x.float().view(1, tokens, heads, head)
    table = create_sinusoidal_positions(int(positions.max()) + 1, rot)
    if base != 10000.0:
        raise ValueError("GPT-J's table is base 10000")
    sin, cos = table[positions, : rot // 2][None], table[positions, rot // 2 :][None]  # [1, T, rot / 2]
    if neox:
        q_rot = x4[..., :rot].transpose(1, 2)  # [1, heads, T, rot]
        full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        rotated, _ = llama_apply(q_rot, q_rot, full_cos, full_sin)
        rotated = rotated.transpose(1, 2)
    else:
        rotated = gptj_apply(x4[..., :rot], sin, cos)
    return torch.cat((rotated, x4[..., rot:]), dim=-1).view(tokens, heads * head)


def _rope_cases(gen: torch.Generator) -> dict[str, Any]:
    from pagedllm.layers.rotary import RotaryEmbedding
    from pagedllm.layers.triton_ops import rotary_embedding

    out: dict[str, Any] = {}
    for dname, dt in DTYPES.items():
        for name, (tokens, heads, kv_heads, head, rot, neox) in ROPE_CASES.items():
            rope = RotaryEmbedding(head, rot, 128, 10000.0, is_neox_style=neox)
            positions = torch.randint(0, 128, (tokens,), generator=gen)
            q_size, kv_size = heads * head, kv_heads * head
            qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dt)
            before = qkv.clone()
            q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
            ref_q = _rope_reference(q, positions, heads, head, rot, neox, 10000.0)
            ref_k = _rope_reference(k, positions, kv_heads, head, rot, neox, 10000.0)
            got_q, got_k = rotary_embedding(
                positions, q, k, rope.cos_cache, rope.sin_cache, head, is_neox_style=neox
            )
            rest = [(slice(None), slice(q_size + kv_size, None))]  # v
            for lo in (0, q_size):  # dims past rotary_dim in each head of q and k
                n = (heads if lo == 0 else kv_heads)
                for h in range(n):
                    rest.append((slice(None), slice(lo + h * head + rot, lo + (h + 1) * head)))
            out[f"{name}_{dname}"] = {
                "q_err": _err(got_q, ref_q),
                "k_err": _err(got_k, ref_k),
                "pass_through_equal": all(bool(torch.equal(qkv[s], before[s])) for s in rest),
                "in_place": got_q.data_ptr() == q.data_ptr() and bool(torch.equal(qkv[:, :q_size], got_q)),
            }
    return out


def _act_cases(gen: torch.Generator) -> dict[str, Any]:
    import torch.nn.functional as F

    from pagedllm.layers.triton_ops import act_and_mul

    out: dict[str, Any] = {}
    for dname, dt in DTYPES.items():
        for name, (rows, d, act) in ACT_CASES.items():
            # gate_up as the MLP produces it, with a strided row (a slice of a wider buffer)
            x = (torch.randn(rows, 2 * d + 3, generator=gen) * 2).to(dt)[:, : 2 * d]
            gate, up = x[:, :d], x[:, d:]
            ref = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
            got = act_and_mul(x, act)
            out[f"{name}_{dname}"] = {
                "err": _err(got, ref), "differ": _differ(got, ref), "shape_ok": got.shape == (rows, d)
            }
    return out


def _layer_cases(gen: torch.Generator) -> dict[str, Any]:
    """Layers with fused_mode 'always' vs 'off'; counts kernel calls to prove the fused branch ran."""
    from pagedllm.layers import triton_ops
    from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
    from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
    from pagedllm.layers.rotary import RotaryEmbedding

    calls = {"rms_norm": 0, "rotary_embedding": 0, "act_and_mul": 0}
    originals = {fn: getattr(triton_ops, fn) for fn in calls}
    for fn, original in originals.items():

        def counted(*args: Any, _fn: Any = original, _name: str = fn, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(triton_ops, fn, counted)

    def both(module: Any, *args: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        set_fused_ops(module, "off")
        ref = module(*[a.clone() for a in args])
        set_fused_ops(module, "always")
        got = module(*[a.clone() for a in args])
        refs = ref if isinstance(ref, tuple) else (ref,)
        gots = got if isinstance(got, tuple) else (got,)
        assert len(refs) == len(gots)
        return list(zip(gots, refs, strict=True))

    errors: dict[str, float] = {}
    x, r = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)
    norm, gnorm = RMSNorm(48), GemmaRMSNorm(48)
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
        gnorm.weight.normal_(generator=gen)
    for key, pairs in (("norm", both(norm, x)), ("norm_residual", both(norm, x, r)),
                       ("gemma_norm", both(gnorm, x))):
        for i, (got, ref) in enumerate(pairs):
            errors[f"{key}_{i}"] = _err(got, ref)
    positions = torch.tensor([3, 0, 7, 7, 1])
    for style in (True, False):
        rope = RotaryEmbedding(16, 8, 16, 10000.0, is_neox_style=style)
        qkv = torch.randn(5, 3 * 32, generator=gen)
        for i, (got, ref) in enumerate(both(rope, positions, qkv[:, :64], qkv[:, 64:])):
            errors[f"rope_neox{style}_{i}"] = _err(got, ref)
    gu = torch.randn(5, 2 * 24, generator=gen)
    for act in (SiluAndMul(), GeluTanhAndMul()):
        ((got, ref),) = both(act, gu)
        errors[type(act).__name__] = _err(got, ref)
    for fn, original in originals.items():
        setattr(triton_ops, fn, original)
    return {"calls": calls, "errors": errors}


def _engine_cases() -> dict[str, Any]:
    """Tiny Llama and Qwen3 through the engine with every fused op forced on, against transformers."""
    import tempfile
    from pathlib import Path

    from pagedllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import hf_greedy, make_tiny_model

    prompts = [[5, 9, 33, 70, 101, 250, 7], list(range(40, 63))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=3)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        for kind in ENGINE_MODELS:
            path = make_tiny_model(kind, Path(root))
            expected = hf_greedy(path, prompts, 6)
            llm = LLM(path, attention={"backend": "torch"}, device="cpu", dtype="float32",
                      max_num_seqs=2, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
            fused = set_fused_ops(llm.engine.parts.model, "always")
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            llm.shutdown()
            delta, equal = 0.0, True
            for o, (hf_tokens, hf_lp) in zip(outs, expected, strict=True):
                comp = o.outputs[0]
                equal = equal and list(comp.token_ids) == hf_tokens
                for step, position in enumerate(comp.logprobs or []):
                    for tid, lp in position.items():
                        delta = max(delta, abs(lp.logprob - float(hf_lp[step, tid])))
            out[kind] = {"fused_modules": fused, "tokens_equal": equal, "max_delta_logprob": delta}
    return out


def _main() -> None:
    """Child process: every case under the interpreter, one JSON line on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    results = {
        "norm": _norm_cases(gen),
        "rope": _rope_cases(gen),
        "act": _act_cases(gen),
        "layers": _layer_cases(gen),
        "engine": _engine_cases(),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
