"""The `cpu` attention backend (plugins/attention/cpu/): its C kernel against the torch reference and float64.

Kernel level: the conformance kit (the torch backend's outputs and cache, slot for slot, on random block tables,
two steps: the history written, then decodes + fresh prompts + chunks over a cached prefix) in bf16 and
float32, with the kit's small cases and SmolLM2's heads (9 query / 3 KV heads of 64, pages of 16); then both
backends against float64 softmax attention computed here from the cache itself, the C kernel no further from it
than the reference is; threads change no bit; a bf16 cache under float32 queries is the float32 kernel on the
rounded K/V, bit for bit, on every instruction-set path and in the quantized model's decode kernel. Selection: what check() refuses, and a bf16 CPU engine picking
it. End to end: a tiny bf16 Llama's greedy tokens equal transformers' own bf16 forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy_with, make_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.api import AttentionSelectionContext
from pagedllm.api.attention import AttentionLayerConfig, CommonAttentionMetadata
from pagedllm.plugins.attention.cpu import _check
from pagedllm.plugins.attention.cpu import backend as cpu_backend
from pagedllm.plugins.attention.cpu.backend import CpuAttentionBackend
from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.testing import check_attention_backend
from pagedllm.testing.attention import AttentionCase

pytestmark = pytest.mark.skipif(
    cpu_backend.paged_attention() is None, reason=f"no C kernel: {cpu_backend.unavailable_reason()}"
)


@pytest.fixture(autouse=True, scope="module")
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class _Float32Probe(CpuAttentionBackend):
    """The backend under a name no registration holds, so the kit runs float32 cases the check refuses."""

    name = "cpu_float32_probe"


# SmolLM2-135M's attention (9 query heads, 3 KV heads of 64) on pages of 16, in steps the engine makes.
_SMOLLM2 = {"num_heads": 9, "num_kv_heads": 3, "head_size": 64, "block_size": 16}
SMOLLM2_CASES = (
    AttentionCase("decodes", (31, 47, 64, 100, 15, 250), (1,) * 6, **_SMOLLM2),  # type: ignore[arg-type]
    # decodes, fresh prompts and chunks continuing a cached prefix, in one step; tiles of 16 rows and a tail
    AttentionCase("mixed", (40, 17, 0, 0, 48, 100), (1, 1, 33, 70, 16, 37), **_SMOLLM2),  # type: ignore[arg-type]
    AttentionCase("window", (60, 0, 30), (1, 90, 45), sliding_window=24, **_SMOLLM2),  # type: ignore[arg-type]
    AttentionCase("soft_cap", (60, 0, 30), (1, 40, 45), logits_soft_cap=30.0, **_SMOLLM2),  # type: ignore[arg-type]
    # a head that is not a multiple of the vector width, more query heads per KV head
    AttentionCase("head_40", (20, 0), (1, 23), num_heads=8, num_kv_heads=2, head_size=40, block_size=16),
    # the tile kernel's tails (paged_attention.c NOTE 5): a head not a multiple of 4, one query head per KV head
    # (16 lanes), eight (a tile of 128 queries), contexts of several 64-key chunks
    AttentionCase("head_50", (0, 100), (140, 17), num_heads=4, num_kv_heads=4, head_size=50, block_size=16),
    AttentionCase("group_8", (0, 5), (40, 20), num_heads=16, num_kv_heads=2, head_size=64, block_size=16),
)


@pytest.mark.parametrize("cases", ["kit", "smollm2"])
def test_bf16_matches_the_torch_backend(cases: str) -> None:
    chosen = SMOLLM2_CASES if cases == "smollm2" else None
    report = check_attention_backend("cpu", dtype=torch.bfloat16, **({"cases": chosen} if chosen else {}))
    assert report.same_layout and not report.skipped and len(report.ran) >= 5


@pytest.mark.parametrize("cases", ["kit", "smollm2"])
def test_float32_matches_the_torch_backend(cases: str) -> None:
    chosen = SMOLLM2_CASES if cases == "smollm2" else None
    report = check_attention_backend(_Float32Probe, dtype=torch.float32, **({"cases": chosen} if chosen else {}))
    assert report.same_layout and not report.skipped and report.max_rel_error < 1e-5


# -- against float64 attention computed here ---------------------------------------------------------------


def _step(
    contexts: list[int], queries: list[int], dtype: torch.dtype, seed: int, bs: int = 16, nh: int = 9, nkv: int = 3,
    hs: int = 64,
) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """One step over a random cache: request i has contexts[i] tokens in it and queries[i] new ones."""
    from pagedllm.worker.input_prep import prepare_inputs

    gen = torch.Generator().manual_seed(seed)
    lens = [c + q for c, q in zip(contexts, queries, strict=True)]
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in lens:
        take = -(-n // bs)
        tables.append(perm[:take])
        perm = perm[take:]
    num_decodes = next((i for i, q in enumerate(queries) if q != 1), len(queries))
    inputs = prepare_inputs([list(range(n)) for n in lens], contexts, queries, tables, bs, torch.device("cpu"),
                            num_decodes)
    tokens = sum(queries)
    q = torch.randn(tokens, nh, hs, generator=gen).to(dtype)
    k = torch.randn(tokens, nkv, hs, generator=gen).to(dtype)
    v = torch.randn(tokens, nkv, hs, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, bs, nkv, hs, generator=gen).to(dtype)
    return inputs.attn, q, k, v, cache, tables


def _float64_attention(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], contexts: list[int], queries: list[int],
    scale: float, window: int | None, soft_cap: float | None,
) -> torch.Tensor:
    """Softmax attention in float64, each request's K/V read from the (already written) cache position by position."""
    _, _, bs, nkv, hs = cache.shape
    nh = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for table, c, n in zip(tables, contexts, queries, strict=True):
        length = c + n
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
        k = cache[0].reshape(-1, nkv, hs)[slots].double().repeat_interleave(nh // nkv, dim=1)  # [L, nh, hs]
        v = cache[1].reshape(-1, nkv, hs)[slots].double().repeat_interleave(nh // nkv, dim=1)
        qq = q[row : row + n].double()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        qpos = torch.arange(c, length)[:, None]
        kpos = torch.arange(length)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window is not None else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[row : row + n] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
        row += n
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (40, None), (None, 20.0)])
def test_no_further_from_float64_than_the_reference(
    dtype: torch.dtype, window: int | None, soft_cap: float | None
) -> None:
    contexts, queries = [300, 17, 64, 0, 90], [1, 1, 1, 150, 61]
    common, q, k, v, cache, tables = _step(contexts, queries, dtype, seed=7)
    layer = AttentionLayerConfig(9, 64, 3, 64**-0.5, window, soft_cap)
    ref_cache = cache.clone()
    got = CpuAttentionBackend.make_impl(layer).forward(q, k, v, cache, CpuAttentionBackend.build_metadata(common))
    ref = TorchSDPABackend.make_impl(layer).forward(q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    assert torch.equal(cache, ref_cache)  # the same K/V written at the same slots
    exact = _float64_attention(q, cache, tables, contexts, queries, layer.scale, window, soft_cap)
    err, ref_err = (got.double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item()
    # bf16: both round the output to bf16 (~2^-9 relative); float32: both sum in float32 (~1e-7).
    assert err <= 1.25 * ref_err + (1e-6 if dtype == torch.float32 else 1e-3), (err, ref_err)
    assert got.dtype == dtype and err < (1e-5 if dtype == torch.float32 else 2e-2)


# The kernel's other instruction-set paths, built with other flags and run here (this CPU has them all).
_ISA_FLAGS = {
    "avx512 without bf16": ["-march=skylake-avx512"],
    "avx2": ["-march=haswell"],
    "plain C": ["-march=x86-64", "-mno-sse3"],
}


def _native_and_isa_impls(isa: str, layer: AttentionLayerConfig) -> tuple[Any, Any]:
    """Two impls of `layer`: the native build's, and one calling the kernel built for `isa` (skips off x86)."""
    import ctypes
    import platform

    from pagedllm.api.kernels import load_native
    from pagedllm.plugins.attention.cpu import paged_attention as pa

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction sets")
    flags = [f for f in pa.FLAGS if f != "-march=native"] + _ISA_FLAGS[isa]
    lib, why = load_native(pa.SOURCE, flags, pa.DISABLE_ENV, "nothing")
    assert lib is not None, why
    native, other = CpuAttentionBackend.make_impl(layer), CpuAttentionBackend.make_impl(layer)
    fn = lib.cpu_paged_attention
    fn.argtypes, fn.restype = native._fn.argtypes, ctypes.c_int  # type: ignore[attr-defined]
    other._fn = fn
    return native, other


@pytest.mark.parametrize("isa", list(_ISA_FLAGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_instruction_set_path_matches(isa: str, dtype: torch.dtype) -> None:
    contexts, queries = [100, 7, 0, 40], [1, 1, 50, 21]
    common, q, k, v, cache, _ = _step(contexts, queries, dtype, seed=11, hs=40)  # a head with a tail
    native, other = _native_and_isa_impls(isa, AttentionLayerConfig(9, 40, 3, 40**-0.5, 30, 25.0))
    md = CpuAttentionBackend.build_metadata(common)
    got, cache2 = other.forward(q, k, v, cache.clone(), md), cache.clone()
    want = native.forward(q, k, v, cache2, md)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= rtol * want.float().abs().max()


def test_threads_change_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    contexts, queries = [200, 33, 7, 0, 120], [1, 1, 1, 80, 40]
    common, q, k, v, cache, _ = _step(contexts, queries, torch.bfloat16, seed=3)
    impl = CpuAttentionBackend.make_impl(AttentionLayerConfig(9, 64, 3, 0.125))
    md = CpuAttentionBackend.build_metadata(common)
    torch.set_num_threads(1)
    one = impl.forward(q, k, v, cache.clone(), md)
    monkeypatch.setattr(cpu_backend, "MIN_WORK_PER_THREAD", 0)  # threads even for this small step
    torch.set_num_threads(2)
    assert torch.equal(impl.forward(q, k, v, cache.clone(), md), one)


def test_float32_decodes_run_the_quantized_models_own_kernel() -> None:
    """With a quantized model's C ops (the gguf method's), a decode-only float32 step -- one decode or a batch --
    runs their decode kernel, the one a model's one-token plan calls, bit for bit, and says so to the plan
    (backend.py NOTE 3); a step with a prompt in it runs paged_attention.c as without them. All within float32
    rounding of float64 attention."""
    from pagedllm.plugins.quantization.gguf.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no fused CPU ops")
    with_ops = CpuAttentionBackend.make_impl(AttentionLayerConfig(9, 64, 3, 0.125, cpu_ops=ops))
    plain = CpuAttentionBackend.make_impl(AttentionLayerConfig(9, 64, 3, 0.125))
    assert with_ops.c_decode_params(ops) == (0.125, 0, 0.0) and plain.c_decode_params(ops) is None
    for contexts, queries in (([70], [1]), ([70, 33, 120], [1, 1, 1]), ([70, 0], [1, 20])):
        common, q, k, v, cache, tables = _step(contexts, queries, torch.float32, seed=5)
        md = CpuAttentionBackend.build_metadata(common)
        decodes = with_ops.c_decode_step(q, k, v, cache, md)
        got_cache, ref_cache = cache.clone(), cache.clone()
        got = with_ops.forward(q, k, v, got_cache, md)
        if set(queries) == {1}:
            assert decodes is not None and plain.c_decode_step(q, k, v, cache, md) is None
            ref = ops.decode_attention(q, k, v, ref_cache, decodes.slot_mapping, decodes.block_table,
                                       decodes.seq_lens, 0.125, None, None)
        else:
            assert decodes is None and md.decodes_only is None
            ref = plain.forward(q, k, v, ref_cache, md)
        assert torch.equal(got, ref) and torch.equal(got_cache, ref_cache)
        exact = _float64_attention(q, got_cache, tables, contexts, queries, 0.125, None, None)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_padding_rows_are_zero_and_bad_slots_are_refused() -> None:
    common, q, k, v, cache, _ = _step([10, 0], [1, 5], torch.bfloat16, seed=1)
    impl = CpuAttentionBackend.make_impl(AttentionLayerConfig(9, 64, 3, 0.125))
    md = CpuAttentionBackend.build_metadata(common)
    padded = torch.cat([q, torch.ones(2, 9, 64, dtype=q.dtype)])  # two rows past the requests' (a padded batch)
    out = impl.forward(padded, torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), cache, md)
    assert out.shape == padded.shape and not out[-2:].any() and out[:-2].abs().sum() > 0
    md.slot_mapping[0] = cache.shape[1] * cache.shape[2]  # one past the last slot
    with pytest.raises(ValueError, match="outside the"):
        impl.forward(q, k, v, cache, md)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        impl.forward(q.half(), k.half(), v.half(), cache.half(), CpuAttentionBackend.build_metadata(common))


# -- selection --------------------------------------------------------------------------------------------


def _ctx(**kw: Any) -> AttentionSelectionContext:
    base: dict[str, Any] = dict(device_type="cpu", compute_capability=None, dtype="bfloat16", kv_cache_dtype="auto",
                                head_size=64, block_size=16)
    return AttentionSelectionContext(**{**base, **kw})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"device_type": "cuda", "compute_capability": (9, 0)}, "CPU tensors only"),
        ({"dtype": "float32"}, "a dense float32 model stays on the exact torch backend"),
        ({"dtype": "float16"}, "bfloat16 and float32 only"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "kv cache dtype fp8_e4m3"),
        ({"kv_cache_dtype": "float16"}, "kv cache dtype float16"),
        ({"sinks": True}, "no attention sinks"),
        ({"chunked_local": True}, "no chunked local attention"),
    ],
)
def test_check_refuses_what_it_does_not_implement(change: dict[str, Any], reason: str) -> None:
    assert _check(_ctx()) == []
    assert _check(_ctx(sliding_window=True, logits_soft_cap=True, kv_cache_dtype="bfloat16")) == []
    assert _check(_ctx(dtype="float32", exact_reference=False)) == []  # a quantized float32 model
    assert _check(_ctx(dtype="float32", exact_reference=False, kv_cache_dtype="bfloat16")) == []  # its bf16 cache
    assert _check(_ctx(kv_cache_dtype="float32")) == []
    assert any(reason in r for r in _check(_ctx(**change)))


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_ATTENTION", "0")
    assert _check(_ctx()) == ["PAGEDLLM_CPU_ATTENTION=0"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_root: Path) -> str:
    return make_tiny_model("llama", tiny_root)


def test_a_bf16_cpu_engine_picks_it_and_float32_keeps_torch(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedllm.cli.main import main

    argv = ["config", "show", "--resolve", "--model", tiny_llama, "--device", "cpu", "--num-kv-blocks", "32",
            "--max-model-len", "64", "--dtype"]
    assert main([*argv, "bfloat16"]) == 0
    assert "attention_backend: cpu (highest priority that passed its checks; priority 10" in capsys.readouterr().out
    assert main([*argv, "float32"]) == 0
    out = capsys.readouterr().out
    assert "attention_backend: torch (" in out
    assert "  - cpu: a dense float32 model stays on the exact torch backend (quantized float32 ones run here)" in out


def test_bf16_greedy_equals_transformers_bf16(tiny_llama: str) -> None:
    """Prefill, chunked prefill (a 16-token step budget splits the 57-token prompt) and batched decode through
    the C kernel, against transformers' own bf16 forward (the same prompts test_cpu_dtype.py holds the torch
    backend to)."""
    import transformers

    prompts = [[1, 17, 33, 200, 5], [1, 250, 9], list(range(3, 60))]
    llm = LLM(tiny_llama, dtype="bfloat16", device="cpu", num_kv_blocks=64, max_model_len=128, block_size=16,
              max_num_batched_tokens=16)
    assert llm.engine.parts.selections["attention"].winner.name == "cpu"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_with(model, p, 12)[0] for p in prompts]


# -- a bf16 cache under float32 queries (backend.py NOTE 4, paged_attention.c NOTE 6) --------------------------


def _bf16_cache_step(
    contexts: list[int], queries: list[int], seed: int, hs: int = 64
) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """_step in float32 with the cache in bf16 (what `kv_cache.cache_dtype: bfloat16` gives a float32 model)."""
    common, q, k, v, cache, tables = _step(contexts, queries, torch.float32, seed=seed, hs=hs)
    return common, q, k, v, cache.to(torch.bfloat16), tables


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as a bf16 cache stores it, back in float32 (round to nearest even: torch's .to(torch.bfloat16))."""
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (40, None), (None, 20.0)])
def test_a_bf16_cache_is_the_float32_kernel_on_the_rounded_values(window: int | None, soft_cap: float | None) -> None:
    """float32 queries over a bf16 cache: every K/V row written rounded as torch rounds it (the torch backend's
    write, slot for slot), and the output bit for bit the float32 kernel's on a float32 cache holding the same
    rounded values (rows widened exactly, summed in the same order) -- decodes, a fresh prompt and a chunk over a
    cached prefix, both the row kernel and the tile kernel; then within float32 rounding of float64 attention
    over the bf16 cache itself."""
    contexts, queries = [300, 17, 64, 0, 90], [1, 1, 1, 150, 61]
    common, q, k, v, cache, tables = _bf16_cache_step(contexts, queries, seed=7)
    layer = AttentionLayerConfig(9, 64, 3, 64**-0.5, window, soft_cap)
    impl = CpuAttentionBackend.make_impl(layer)
    md = CpuAttentionBackend.build_metadata(common)
    ref_cache, f32_cache = cache.clone(), cache.float()
    got = impl.forward(q, k, v, cache, md)
    TorchSDPABackend.make_impl(layer).forward(q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    assert torch.equal(cache, ref_cache)  # the same bf16 K/V rows at the same slots
    same = impl.forward(q, _rounded(k), _rounded(v), f32_cache, md)
    assert torch.equal(f32_cache.to(torch.bfloat16), cache)
    assert got.dtype == torch.float32 and torch.equal(got, same)
    exact = _float64_attention(q, cache, tables, contexts, queries, layer.scale, window, soft_cap)
    assert (got.double() - exact).abs().max().item() < 1e-5


def test_a_bf16_cache_costs_what_rounding_k_and_v_costs() -> None:
    """Against float64 attention over the float32 K/V (before rounding): the bf16 cache's error is that of
    bf16 K/V (~2^-9 relative), far above float32's and far below a wrong result."""
    contexts, queries = [300, 0, 90], [1, 150, 61]
    common, q, k, v, cache32, tables = _step(contexts, queries, torch.float32, seed=9)
    layer = AttentionLayerConfig(9, 64, 3, 64**-0.5)
    impl = CpuAttentionBackend.make_impl(layer)
    cache16 = cache32.to(torch.bfloat16)
    got32 = impl.forward(q, k, v, cache32, CpuAttentionBackend.build_metadata(common))
    got16 = impl.forward(q, k, v, cache16, CpuAttentionBackend.build_metadata(common))
    exact = _float64_attention(q, cache32, tables, contexts, queries, layer.scale, None, None)
    err32, err16 = (got32.double() - exact).abs().max().item(), (got16.double() - exact).abs().max().item()
    assert err32 < 1e-5 and 1e-5 < err16 < 2e-2, (err32, err16)


def test_a_bf16_cache_under_float32_decodes_runs_the_quantized_models_kernel() -> None:
    """Decode-only float32 steps with the gguf method's C ops run cpu_ops.c's decode kernel over a bf16 cache too
    (the kernel a model's one-token plan runs), bit for bit that kernel on a float32 cache of the rounded values,
    and within float32 rounding of float64 attention over the bf16 cache."""
    from pagedllm.plugins.quantization.gguf.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no fused CPU ops")
    contexts, queries = [70, 33, 120, 5], [1, 1, 1, 1]
    common, q, k, v, cache, tables = _bf16_cache_step(contexts, queries, seed=5)
    with_ops = CpuAttentionBackend.make_impl(AttentionLayerConfig(9, 64, 3, 0.125, cpu_ops=ops))
    md = CpuAttentionBackend.build_metadata(common)
    decodes = with_ops.c_decode_step(q, k, v, cache, md)
    assert decodes is not None
    ref_cache, f32_cache = cache.clone(), cache.float()
    got = with_ops.forward(q, k, v, cache, md)
    TorchSDPABackend.make_impl(AttentionLayerConfig(9, 64, 3, 0.125)).forward(
        q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    assert torch.equal(cache, ref_cache)
    same = ops.decode_attention(q, _rounded(k), _rounded(v), f32_cache, decodes.slot_mapping, decodes.block_table,
                                decodes.seq_lens, 0.125, None, None)
    assert torch.equal(got, same)
    exact = _float64_attention(q, cache, tables, contexts, queries, 0.125, None, None)
    assert (got.double() - exact).abs().max().item() < 1e-5


@pytest.mark.parametrize("isa", list(_ISA_FLAGS))
def test_every_instruction_set_path_reads_a_bf16_cache(isa: str) -> None:
    """The portable paths (AVX-512 without BF16, AVX2, plain C) read a bf16 cache under float32 queries as the
    native build does: the same written cache, outputs within float32 rounding."""
    contexts, queries = [100, 7, 0, 40], [1, 1, 50, 21]
    common, q, k, v, cache, _ = _bf16_cache_step(contexts, queries, seed=11, hs=40)  # a head with a tail
    native, other = _native_and_isa_impls(isa, AttentionLayerConfig(9, 40, 3, 40**-0.5, 30, 25.0))
    md = CpuAttentionBackend.build_metadata(common)
    cache2 = cache.clone()
    got = other.forward(q, k, v, cache, md)
    want = native.forward(q, k, v, cache2, md)
    assert torch.equal(cache, cache2)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_bf16_model_may_keep_a_float32_cache() -> None:
    """The other mix (`kv_cache.cache_dtype: float32` under a bf16 model): rows widened as they are written,
    the output the bf16 kernel's within bf16 rounding of float64 attention over that cache."""
    contexts, queries = [80, 0], [1, 40]
    common, q, k, v, cache, tables = _step(contexts, queries, torch.bfloat16, seed=4)
    cache = cache.float()
    layer = AttentionLayerConfig(9, 64, 3, 0.125)
    got = CpuAttentionBackend.make_impl(layer).forward(q, k, v, cache, CpuAttentionBackend.build_metadata(common))
    assert got.dtype == torch.bfloat16
    exact = _float64_attention(q, cache, tables, contexts, queries, 0.125, None, None)
    assert (got.double() - exact).abs().max().item() < 2e-2
