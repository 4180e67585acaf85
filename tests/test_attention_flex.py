"""The flex attention backend: the conformance kit against the torch reference, chunked local attention
against plain softmax attention, a broken mask mod caught, and engine greedy tokens equal to the torch
backend's and transformers' on tiny random Llama and Gemma-2 (sliding window + soft-cap) models."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy

from pagedllm.plugins.attention.flex import FlexOptions, paged_mask
from pagedllm.plugins.attention.flex.backend import FlexAttentionBackend
from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.testing.attention import AttentionCase, check_attention_backend
from pagedllm.testing.engine_run import run_greedy
from pagedllm.testing.tiny import save_tiny_model
from pagedllm.worker.input_prep import prepare_inputs


@pytest.fixture(autouse=True)
def _quiet_eager() -> Iterator[None]:
    # Eager flex_attention warns once that it is unfused: that is the CPU default here (FlexOptions.compile).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def test_conformance_against_torch() -> None:
    report = check_attention_backend("flex")
    # It claims sliding window and soft-cap: those cases must have run, not been skipped.
    assert {"sliding_window", "soft_cap", "window_and_soft_cap", "mixed_chunked", "mqa"} <= set(report.ran)
    assert not report.skipped and report.same_layout
    assert report.max_rel_error < 1e-5


def test_bf16_against_torch() -> None:
    cases = (AttentionCase("mixed", (5, 8, 0, 5), (1, 1, 7, 6)),
             AttentionCase("window_soft_cap", (9, 0, 6), (1, 9, 5), sliding_window=3, logits_soft_cap=1.5))
    assert check_attention_backend("flex", dtype=torch.bfloat16, cases=cases).ran == ["mixed", "window_soft_cap"]


def _wrong_mask(kind: str) -> Any:
    real = paged_mask._mask_mod

    def make(q_req: Any, q_pos: Any, p2l: Any, bs: int, window: int | None, chunk: int | None) -> Any:
        if kind == "no_window":  # forgets the sliding window
            return real(q_req, q_pos, p2l, bs, None, chunk)
        causal = real(q_req, q_pos, p2l, bs, window, chunk)
        # sees one position into the future (still inside the pages the block mask lists)
        return lambda b, h, q, k: causal(b, h, q, k) | causal(b, h, q, k - 1)

    return make


@pytest.mark.parametrize("kind", ["no_window", "one_ahead"])
def test_a_wrong_mask_mod_fails_the_check(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setattr(paged_mask, "_mask_mod", _wrong_mask(kind))
    case = AttentionCase("sliding_window", (9, 0, 6), (1, 9, 5), sliding_window=5)
    with pytest.raises(AssertionError, match="output"):
        check_attention_backend("flex", cases=(case,))


@dataclass(frozen=True)
class _ChunkedLayer(AttentionLayerConfig):
    # What a Llama 4 layer will carry once AttentionLayerConfig has the field (FlexAttentionImpl reads it).
    attention_chunk_size: int | None = None


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], chunk: int,
                     scale: float) -> torch.Tensor:
    """Plain softmax attention of one request's new rows over its whole context, chunked-local causal."""
    group = q.shape[1] // k.shape[1]
    keys = torch.arange(k.shape[0])
    qp = torch.tensor(positions)
    allowed = (keys[None, :] <= qp[:, None]) & (keys[None, :] // chunk == qp[:, None] // chunk)
    scores = torch.einsum("thd,khd->htk", q, k.repeat_interleave(group, 1)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("htk,khd->thd", probs, v.repeat_interleave(group, 1))


def test_chunked_local_against_dense_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    bs, chunk, heads, kv_heads, hd = 4, 6, 4, 2, 16
    contexts, queries = [11, 0, 7], [1, 14, 6]  # a decode, a fresh prompt, a chunk: all cross chunk edges
    lengths = [c + n for c, n in zip(contexts, queries, strict=True)]
    perm = (torch.randperm(40, generator=gen) + 1).tolist()
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lengths]
    full = [tuple(torch.randn(n, h, hd, generator=gen) for h in (heads, kv_heads, kv_heads)) for n in lengths]
    cache = torch.zeros(FlexAttentionBackend.kv_cache_shape(42, bs, kv_heads, hd))
    # The cached contexts go straight into their slots; the step then writes and attends the new rows.
    for (c, _), table, (_, k, v) in zip(zip(contexts, queries, strict=True), tables, full, strict=True):
        for p in range(c):
            cache[0, table[p // bs], p % bs], cache[1, table[p // bs], p % bs] = k[p], v[p]
    common = prepare_inputs([list(range(n)) for n in lengths], contexts, queries, tables, bs, torch.device("cpu"), 1).attn
    layer = _ChunkedLayer(heads, hd, kv_heads, hd**-0.5, attention_chunk_size=chunk)
    q, k, v = (torch.cat([f[i][c:] for f, c in zip(full, contexts, strict=True)]) for i in range(3))
    out = FlexAttentionBackend.make_impl(layer).forward(q, k, v, cache, FlexAttentionBackend.build_metadata(common))
    row = 0
    for (c, n), (fq, fk, fv) in zip(zip(contexts, queries, strict=True), full, strict=True):
        want = _dense_reference(fq[c:], fk, fv, list(range(c, c + n)), chunk, hd**-0.5)
        torch.testing.assert_close(out[row : row + n], want, rtol=1e-5, atol=1e-5)
        row += n
    # The chunk really matters on this batch: without it the outputs differ.
    plain = FlexAttentionBackend.make_impl(AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5))
    assert not torch.allclose(plain.forward(q, k, v, cache.clone(), FlexAttentionBackend.build_metadata(common)), out)


def test_never_auto_picked_but_runs_when_named() -> None:
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind
    from pagedllm.selector import select

    pm = get_plugin_manager()
    cpu = AttentionSelectionContext("cpu", None, "float32", "auto", 64, 16, sliding_window=True,
                                    logits_soft_cap=True)
    h200 = AttentionSelectionContext("cuda", (9, 0), "bfloat16", "auto", 128, 16)
    for ctx in (cpu, h200):
        sel = select(pm, PluginKind.ATTENTION, ctx)
        assert sel.winner.name != "flex"
        assert select(pm, PluginKind.ATTENTION, ctx, requested="flex").winner.name == "flex"
    # What it cannot do is a reason, named: an fp8 cache.
    from dataclasses import replace

    spec = pm.get(PluginKind.ATTENTION, "flex")
    assert spec is not None and spec.reasons_against(replace(cpu, kv_cache_dtype="fp8_e4m3"))
    with pytest.raises(ValueError, match="compile"):
        FlexOptions.model_validate({"compile": "sometimes"})


VOCAB = 384
NEW = 12


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_engine_greedy_equals_torch_and_transformers(tiny_root: Path, kind: str) -> None:
    rng = random.Random(0)
    # Longer than gemma2's window of 8 and many pages of 4: windows and page edges are crossed.
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (13, 27, 21)]
    path = save_tiny_model(kind, tiny_root)
    # 12 new tokens: eager flex_attention costs ~10-50 ms a call on the CPU (its unfused path), and this is
    # the file's budget; the prompts still end past gemma2's window so decodes slide it.
    # Llama through the options path: 4-row query groups mix requests inside one block-mask row.
    options = {"plugins": {"flex": {"q_block_size": 4}}} if kind == "llama" else {}
    flex = run_greedy(path, prompts, NEW, config={"attention": {"backend": "flex"}, **options})
    torch_run = run_greedy(path, prompts, NEW, config={"attention": {"backend": "torch"}})
    assert any(n > 1 for n, _ in flex.steps) and any(r > 1 for _, r in flex.steps)  # batched, chunked steps
    assert flex.tokens == torch_run.tokens
    assert flex.tokens == [tokens for tokens, _ in hf_greedy(path, prompts, NEW)]


def test_a_bad_option_is_an_error_naming_it(tiny_root: Path) -> None:
    from pagedllm.config import ConfigError

    path = save_tiny_model("llama", tiny_root)
    with pytest.raises(ConfigError, match="plugins.flex.compile"):
        run_greedy(path, [[5, 6, 7]], 1, config={"attention": {"backend": "flex"},
                                                  "plugins": {"flex": {"compile": "sometimes"}}})
