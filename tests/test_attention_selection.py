"""Choosing among torch, triton, flashinfer and flash_attn per GPU, with the machine faked.

No GPU and neither library is installed here: `find_spec` (FlashInfer's `requires`) and the FlashAttention
plugin's `installed_variants()` are faked, and the GPU is described by the selection context. The real
in-tree registrations and the real selector run; only the facts about the machine are invented.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedllm.plugin_manager import get_plugin_manager
from pagedllm.plugin_spec import PluginKind, PluginLoadError
from pagedllm.plugins.attention import flash_attn
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.selector import Selection, SelectionError, select

H200 = AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16)
B200 = replace(H200, compute_capability=(10, 0))
A100 = replace(H200, compute_capability=(8, 0))
L40 = replace(H200, compute_capability=(8, 9))
CPU = AttentionSelectionContext("cpu", None, "float32", "auto", 64, 16)
IN_TREE = ("torch", "triton", "flashinfer", "flash_attn")

FA4 = flash_attn.Variant("fa4", "flash_attn.cute.interface", "flash-attn-4", "4.0.0b36", (9, 0), 11, 1)
FA3 = flash_attn.Variant("fa3", "flash_attn_interface", "flash-attn-3", "3.0.0", (9, 0), 9, 1)
FA2 = flash_attn.Variant("fa2", "flash_attn", "flash-attn", "2.8.3", (8, 0), 12, 256)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install (on paper) flashinfer and the given FlashAttention variants; triton is really installed."""

    def install(*variants: flash_attn.Variant, flashinfer: bool = True) -> None:
        real = importlib.util.find_spec

        def find_spec(name: str, *args: Any) -> Any:
            if name == "flashinfer":
                return object() if flashinfer else None
            return real(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(flash_attn, "installed_variants", lambda: tuple(variants))

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return install


def _select(ctx: AttentionSelectionContext, requested: str | None = None) -> Selection:
    pm = get_plugin_manager()
    pool = [c for c in pm.components(PluginKind.ATTENTION) if c.name in IN_TREE and c.distribution == "pagedllm"]
    if importlib.util.find_spec("triton") is None:  # the triton row needs the package; fake it in like the rest
        pool = [c for c in pool if c.name != "triton"]
    return select(pm, PluginKind.ATTENTION, ctx, requested=requested, candidates=pool)


def _reasons(selection: Selection) -> dict[str, str]:
    return {spec.name: "; ".join(reasons) for spec, reasons in selection.rejected}


def test_hopper_orders_flash_attn_flashinfer_triton_torch(machine: Any) -> None:
    machine(FA3, FA4)
    sel = _select(H200)
    assert sel.winner.name == "flash_attn"
    why = _reasons(sel)
    assert why["flashinfer"] == "lower priority (100) than flash_attn (110)"
    assert why["torch"] == "lower priority (0) than flash_attn (110)"
    assert "priority 110" in sel.explain()
    # fa3 is the Hopper choice when both are installed; fa4 where fa3 cannot run (Blackwell).
    assert flash_attn.choose(H200)[0] == FA3
    assert flash_attn.choose(B200)[0] == FA4


def test_cuda_graph_engines_prefer_triton_until_the_others_capture(machine: Any) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    machine(FA3, FA4)
    sel = _select(replace(H200, cuda_graphs=True))
    assert sel.winner.name == "triton"
    why = _reasons(sel)
    assert why["flashinfer"] == "lower priority (45) than triton (50)"
    assert why["flash_attn"] == "lower priority (40) than triton (50)"
    # Asked for by name they still serve (eagerly).
    assert _select(replace(H200, cuda_graphs=True), requested="flash_attn").winner.name == "flash_attn"


def test_blackwell_puts_flashinfer_first(machine: Any) -> None:
    machine(FA4)
    sel = _select(B200)
    assert sel.winner.name == "flashinfer"
    assert _reasons(sel)["flash_attn"] == "lower priority (90) than flashinfer (100)"


def test_ampere_fa2_needs_pages_of_256(machine: Any) -> None:
    machine(FA2)
    sel = _select(A100)
    assert sel.winner.name == "flashinfer"
    assert "block size 16 is not a multiple of 256" in _reasons(sel)["flash_attn"]
    assert _select(replace(A100, block_size=256)).winner.name == "flash_attn"


def test_features_rule_backends_out_with_reasons(machine: Any) -> None:
    machine(FA3, FA4)
    # Head size 96: FlashAttention runs it, FlashInfer's templates do not.
    sel = _select(replace(H200, head_size=96))
    assert sel.winner.name == "flash_attn"
    assert "head size 96 not in (64, 128, 256)" in _reasons(sel)["flashinfer"]
    # An fp8 KV cache: FlashAttention refuses it, FlashInfer takes it on Hopper ...
    sel = _select(replace(H200, kv_cache_dtype="fp8_e4m3"))
    assert sel.winner.name == "flashinfer"
    assert "kv cache dtype fp8_e4m3 not supported" in _reasons(sel)["flash_attn"]
    # ... and on Ada (8.9) but not Ampere, where only the torch reference can hold fp8 pages.
    assert _select(replace(L40, kv_cache_dtype="fp8_e4m3")).winner.name == "flashinfer"
    sel = _select(replace(A100, kv_cache_dtype="fp8_e4m3"))
    assert sel.winner.name == "torch"
    assert "fp8 kv cache needs compute capability >= 8.9" in _reasons(sel)["flashinfer"]
    if "triton" in _reasons(sel):
        assert "fp8 kv cache needs compute capability >= 8.9" in _reasons(sel)["triton"]
    # float32 models: only triton and torch.
    sel = _select(replace(H200, dtype="float32"))
    assert sel.winner.name in ("triton", "torch")
    assert "dtype float32 not supported" in _reasons(sel)["flashinfer"]
    assert "dtype float32 not supported" in _reasons(sel)["flash_attn"]
    # Sliding window and soft-cap: every backend here handles both (they are plan / call arguments).
    assert _select(replace(H200, sliding_window=True, logits_soft_cap=True)).winner.name == "flash_attn"


def test_cpu_without_the_packages_says_why_each_is_unavailable(machine: Any) -> None:
    machine(flashinfer=False)
    sel = _select(CPU)
    assert sel.winner.name == "torch"
    why = _reasons(sel)
    assert why["flashinfer"] == "package providing 'flashinfer' is not installed"
    assert why["flash_attn"].startswith("no FlashAttention library installed (flash-attn-4")
    if "triton" in why:
        assert "needs cuda" in why["triton"]


def test_pagedllm_plugins_lists_the_reasons(machine: Any) -> None:
    from pagedllm.cli.plugins_cmd import collect

    machine(flashinfer=False)
    rows = {c["name"]: c for c in collect()["components"] if c["kind"] == "attention_backend"}
    assert not rows["flashinfer"]["available"] and not rows["flash_attn"]["available"]
    assert rows["flashinfer"]["reasons"] == ["package providing 'flashinfer' is not installed"]
    assert "no FlashAttention library installed" in rows["flash_attn"]["reasons"][0]
    assert rows["torch"]["available"]


def test_a_named_backend_that_cannot_serve_fails_with_its_reasons(machine: Any) -> None:
    machine(flashinfer=False)
    with pytest.raises(SelectionError) as info:
        _select(CPU, requested="flashinfer")
    assert str(info.value) == (
        "attention_backend 'flashinfer' (from pagedllm) was requested but cannot be used: "
        "package providing 'flashinfer' is not installed"
    )


def test_a_named_backend_whose_library_does_not_import_names_the_plugin(machine: Any) -> None:
    machine(FA4)  # both "installed" on paper, neither importable here
    for name in ("flashinfer", "flash_attn"):
        selection = _select(H200, requested=name)
        with pytest.raises(PluginLoadError) as info:
            selection.load()
        message = str(info.value)
        assert f"attention_backend '{name}' from plugin '" in message and "(distribution pagedllm" in message
        assert "failed to load" in message


def test_engine_build_names_the_backend_that_cannot_load(tiny_root: Any) -> None:
    from tiny_models import make_tiny_model

    from pagedllm import LLM

    with pytest.raises(SelectionError, match="'flashinfer' .* was requested but cannot be used: package"):
        LLM(make_tiny_model("llama", tiny_root), attention={"backend": "flashinfer"}, device="cpu")


def test_priority_for_that_raises_falls_back_to_the_fixed_priority() -> None:
    from pagedllm.plugin_spec import ComponentSpec
    from pagedllm.selector import effective_priority

    def broken(ctx: Any) -> int:
        raise RuntimeError("no")

    spec = ComponentSpec(PluginKind.ATTENTION, "x", lambda: None, priority=7, meta={"priority_for": broken})
    assert effective_priority(spec, H200) == 7
    spec.meta["priority_for"] = lambda ctx: 3
    assert effective_priority(spec, H200) == 3


def test_flashinfer_page_plan_describes_the_torch_backends_context() -> None:
    """FlashInfer's CSR arrays, read back the way FlashInfer defines them, give the torch oracle's answer."""
    from pagedllm.plugins.attention.flashinfer.plan import paged_kv_plan
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.protocols.attention import AttentionLayerConfig
    from pagedllm.worker.input_prep import prepare_inputs

    gen = torch.Generator().manual_seed(0)
    block, heads, kv_heads, head = 4, 4, 2, 16
    contexts, queries = [5, 8, 3, 0, 5], [1, 1, 1, 7, 6]  # three decodes, a fresh prefill, a chunk
    num_blocks = 40
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for c, q in zip(contexts, queries, strict=True):
        n = -(-(c + q) // block)
        tables.append(perm[used : used + n])
        used += n
    common = prepare_inputs([list(range(c + q)) for c, q in zip(contexts, queries, strict=True)],
                            contexts, queries, tables, block, torch.device("cpu"), 3).attn
    plan = paged_kv_plan(common)
    assert plan.decode is not None and plan.prefill is not None
    assert (plan.decode.num_reqs, plan.prefill.num_reqs) == (3, 2)
    assert (plan.decode.query_start, plan.decode.query_end, plan.prefill.query_end) == (0, 3, 16)

    cache = torch.randn(2, num_blocks, block, kv_heads, head, generator=gen)
    q = torch.randn(16, heads, head, generator=gen)
    layer = AttentionLayerConfig(heads, head, kv_heads, head**-0.5)
    # The torch backend writes this step's K/V; the CSR reader below then reads the same cache.
    k_new = torch.randn(16, kv_heads, head, generator=gen)
    ref = TorchSDPABackend.make_impl(layer).forward(q, k_new, k_new, cache, TorchSDPABackend.build_metadata(common))

    got = torch.empty_like(q)
    for part in (plan.decode, plan.prefill):
        for i in range(part.num_reqs):
            pages = part.kv_indices[part.kv_indptr_cpu[i] : part.kv_indptr_cpu[i + 1]].long()
            n_keys = (len(pages) - 1) * block + int(part.last_page_len_cpu[i])
            k = cache[0, pages].reshape(-1, kv_heads, head)[:n_keys].repeat_interleave(heads // kv_heads, 1)
            v = cache[1, pages].reshape(-1, kv_heads, head)[:n_keys].repeat_interleave(heads // kv_heads, 1)
            lo = part.query_start + int(part.qo_indptr_cpu[i])
            hi = part.query_start + int(part.qo_indptr_cpu[i + 1])
            rows = torch.arange(hi - lo)[:, None] + n_keys - (hi - lo)  # bottom-right causal alignment
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi], k) * layer.scale
            scores = scores.masked_fill(torch.arange(n_keys)[None, None, :] > rows[None], float("-inf"))
            got[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_in_tree_backends_are_registered() -> None:
    real = {c.name for c in get_plugin_manager().components(PluginKind.ATTENTION) if c.distribution == "pagedllm"}
    assert set(IN_TREE) <= real
