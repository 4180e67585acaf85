"""Our Llama / Qwen2 / Qwen3 on the paged torch backend against transformers, plus loader and input tests.

Every model case is a tiny random checkpoint saved with `save_pretrained` and read back through HFLoader;
the cache uses block_size 4 and shuffled block ids. Logits of every scheduled row must match transformers'
logits at the same positions of the whole sequence (transformers is causal, so one forward covers all).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

from model_utils import PagedRunner, hf_logits, load_ours, make_hf_model  # noqa: E402

from pagedllm.layers.weight_utils import WeightLoadError  # noqa: E402
from pagedllm.plugins.loaders.hf.loader import HFLoader  # noqa: E402

TOL = 1e-4
_TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _config(case: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if case == "llama_untied":
        return LlamaConfig(**_TINY, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if case == "llama_tied":
        return LlamaConfig(**_TINY, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    if case == "llama3_rope":
        # original_max_position_embeddings=16 puts head_dim 16's wavelengths in all three llama3 bands.
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
        return LlamaConfig(
            **_TINY, rope_scaling=scaling, rope_theta=10000.0, architectures=["LlamaForCausalLM"]
        )
    if case == "mistral_window":
        # A window shorter than the prompts: both the decode and the prefill masks must cut it.
        return MistralConfig(**_TINY, sliding_window=5, head_dim=16, architectures=["MistralForCausalLM"])
    if case == "qwen2":
        return Qwen2Config(**_TINY, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if case == "qwen3":
        # head_dim 32 != hidden / heads = 16: the explicit head_dim must win.
        return Qwen3Config(
            **_TINY, head_dim=32, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"]
        )
    raise KeyError(case)


CASES = ["llama_untied", "llama_tied", "llama3_rope", "mistral_window", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(_config(request.param))
    hf.save_pretrained(path)
    return path, hf


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(_TINY["vocab_size"]) for _ in range(n)]


def _check(case: str, hf: Any, tokens: list[int], start: int, ours: torch.Tensor) -> float:
    """Compare our logits for positions start .. start+len(ours)-1 with transformers'."""
    ref = hf_logits(hf, tokens)[start : start + ours.shape[0]]
    delta = (ours - ref).abs().max().item()
    assert delta < TOL, (
        f"{case}: max |Δ logits| {delta:.2e} at positions {start}..{start + ours.shape[0] - 1}"
    )
    return delta


def test_prefill_then_decode(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model, _ = load_ours(str(path))
    runner = PagedRunner(model)
    tokens = _prompt(11, seed=1)  # not a multiple of block_size
    deltas = [_check(path.name, hf, tokens, 0, runner.step([("a", tokens, len(tokens))])[0])]
    print(f"\n{path.name}: prefill max |Δ logits| = {deltas[0]:.2e}")
    last = hf_logits(hf, tokens)[-1]
    for _ in range(5):
        tokens = tokens + [int(last.argmax())]
        out = runner.step([("a", tokens, 1)])[0]
        deltas.append(_check(path.name, hf, tokens, len(tokens) - 1, out))
        last = out[-1]
    print(f"{path.name}: decode max |Δ logits| = {max(deltas[1:]):.2e}")


def test_chunked_prefill(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model, _ = load_ours(str(path))
    runner = PagedRunner(model, seed=3)
    tokens = _prompt(14, seed=2)
    done, deltas = 0, []
    for chunk in (5, 3, 6):  # boundaries inside blocks: a chunk resumes a half-written block
        out = runner.step([("a", tokens, chunk)])[0]
        deltas.append(_check(path.name, hf, tokens, done, out))
        done += chunk
    tokens = tokens + [int(out[-1].argmax())]
    deltas.append(_check(path.name, hf, tokens, done, runner.step([("a", tokens, 1)])[0]))
    print(f"\n{path.name}: chunked prefill max |Δ logits| = {max(deltas):.2e}")


def test_mixed_batch(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model, _ = load_ours(str(path))
    runner = PagedRunner(model, seed=5)
    a, b = _prompt(7, seed=3), _prompt(10, seed=4)
    a = a + [int(runner.step([("a", a, len(a))])[0][-1].argmax())]
    deltas = []
    # One decode (a) next to a prefill chunk (b), then a's decode next to the rest of b's prompt.
    out_a, out_b = runner.step([("a", a, 1), ("b", b, 6)])
    deltas += [_check(path.name, hf, a, len(a) - 1, out_a), _check(path.name, hf, b, 0, out_b)]
    a = a + [int(out_a[-1].argmax())]
    out_a, out_b = runner.step([("a", a, 1), ("b", b, 4)])
    deltas += [_check(path.name, hf, a, len(a) - 1, out_a), _check(path.name, hf, b, 6, out_b)]
    # Two decodes of different lengths in one vectorised batch.
    for _ in range(3):
        a, b = a + [int(out_a[-1].argmax())], b + [int(out_b[-1].argmax())]
        out_a, out_b = runner.step([("a", a, 1), ("b", b, 1)])
        deltas += [_check(path.name, hf, a, len(a) - 1, out_a), _check(path.name, hf, b, len(b) - 1, out_b)]
    print(f"\n{path.name}: mixed batch max |Δ logits| = {max(deltas):.2e}")


# --- HFLoader ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("llama_loader")
    hf = make_hf_model(_config("llama_untied"))
    hf.save_pretrained(path)
    return path, hf


def test_loader_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert HFLoader().check(str(missing))
    with pytest.raises(FileNotFoundError, match="nope"):
        HFLoader().load_info(str(missing))


def test_loader_info(llama_dir: tuple[Path, Any]) -> None:
    info = HFLoader().load_info(str(llama_dir[0]))
    assert info.hf_config.architectures == ["LlamaForCausalLM"]
    assert info.tokenizer is None  # no tokenizer files were saved
    assert info.eos_token_ids == [2]
    assert info.quantization_config is None
    assert HFLoader().check(str(llama_dir[0])) == []


def test_loader_corrupt_safetensors(llama_dir: tuple[Path, Any], tmp_path: Path) -> None:
    path = tmp_path / "corrupt"
    shutil.copytree(llama_dir[0], path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated: header promises more than is there
    with pytest.raises(WeightLoadError, match=r"model\.safetensors.*corrupt"):
        load_ours(str(path))
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(WeightLoadError, match=r"model\.safetensors.*corrupt"):
        load_ours(str(path))


def test_loader_missing_tensor(llama_dir: tuple[Path, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "missing"
    shutil.copytree(llama_dir[0], path)
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        WeightLoadError, match=r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"
    ) as err:
        load_ours(str(path))
    assert str(path) in str(err.value)


def test_loader_unexpected_tensor(llama_dir: tuple[Path, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "extra"
    shutil.copytree(llama_dir[0], path)
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="mystery.*matches no model parameter") as err:
        load_ours(str(path))
    assert str(path) in str(err.value)


def test_loader_sharded_checkpoint(llama_dir: tuple[Path, Any], tmp_path: Path) -> None:
    _, hf = llama_dir
    path = tmp_path / "sharded"
    hf.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    model, _ = load_ours(str(path))
    tokens = _prompt(9, seed=7)
    delta = _check("sharded", hf, tokens, 0, PagedRunner(model).step([("a", tokens, len(tokens))])[0])
    print(f"\nsharded checkpoint: prefill max |Δ logits| = {delta:.2e}")


def test_dummy_loader(llama_dir: tuple[Path, Any]) -> None:
    from pagedllm.plugins.loaders.dummy.loader import DummyLoader

    path = str(llama_dir[0])
    model, _ = load_ours(path)
    info = DummyLoader().load_info(path)
    DummyLoader().load_weights(model, path, info)
    first = {name: p.clone() for name, p in model.named_parameters()}
    assert all(p.abs().max() <= 1e-3 and p.abs().max() > 0 for p in first.values())
    DummyLoader().load_weights(model, path, info)
    assert all(torch.equal(first[name], p) for name, p in model.named_parameters())  # seeded


def test_loader_bin_fallback(llama_dir: tuple[Path, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src, hf = llama_dir
    path = tmp_path / "bin"
    path.mkdir()
    shutil.copy(src / "config.json", path / "config.json")
    torch.save(load_file(src / "model.safetensors"), path / "pytorch_model.bin")
    model, _ = load_ours(str(path))
    tokens = _prompt(6, seed=8)
    _check("bin", hf, tokens, 0, PagedRunner(model).step([("a", tokens, len(tokens))])[0])


# --- step inputs and tensor-parallel sharding ------------------------------------------------------------


def test_prepare_inputs_accounting() -> None:
    from pagedllm.worker.input_prep import prepare_inputs

    decode = list(range(100, 107))  # 7 known, 6 computed: decode position 6
    chunk = list(range(200, 210))  # 10-token prompt, 3 computed, next chunk of 4: positions 3..6
    step = prepare_inputs(
        token_ids=[decode, chunk],
        num_computed=[6, 3],
        num_scheduled=[1, 4],
        block_ids=[[7, 2], [5, 1]],
        block_size=4,
        device=torch.device("cpu"),
        num_decodes=1,
    )
    assert step.input_ids.tolist() == [106, 203, 204, 205, 206]
    assert step.positions.tolist() == [6, 3, 4, 5, 6]
    # pos 6 of [7, 2] -> block 2 offset 2 = 10; pos 3 of [5, 1] -> 5*4+3 = 23, then block 1 offsets 0..2.
    assert step.attn.slot_mapping.tolist() == [10, 23, 4, 5, 6]
    assert step.logits_indices.tolist() == [0, 4]
    assert step.attn.query_start_loc.tolist() == [0, 1, 5]
    assert step.attn.seq_lens.tolist() == [7, 7]
    assert step.attn.block_table.tolist() == [[7, 2], [5, 1]]
    assert (step.attn.max_query_len, step.attn.max_seq_len, step.attn.num_actual_tokens) == (4, 7, 5)
    with pytest.raises(ValueError, match="blocks"):
        prepare_inputs([chunk], [0], [9], [[1, 2]], 4, torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="num_decodes"):
        prepare_inputs([chunk], [0], [4], [[1]], 4, torch.device("cpu"), 1)


def _tp_ctx(rank: int, size: int) -> Any:
    from pagedllm.protocols.model import ModelBuildContext

    return ModelBuildContext(
        hf_config=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attn_backend=None,
        quant_config=None,
        block_size=4,
        tp_rank=rank,
        tp_size=size,
    )


def test_tensor_parallel_mlp_shards_sum_to_full() -> None:
    """gate_up (merged column) -> down (row): per-rank partial sums add up to the unsharded result."""
    from pagedllm.layers.activation import SiluAndMul
    from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(12, 8, generator=gen), torch.randn(12, 8, generator=gen)
    down, x = torch.randn(8, 12, generator=gen), torch.randn(3, 8, generator=gen)

    def partial(rank: int, size: int) -> torch.Tensor:
        gate_up = MergedColumnParallelLinear(_tp_ctx(rank, size), 8, [12, 12])
        down_proj = RowParallelLinear(_tp_ctx(rank, size), 12, 8)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        down_proj.weight.weight_loader(down_proj.weight, down)
        # The row layer's partial product, before the all-reduce that tp_size > 1 would do.
        return down_proj.quant_method.apply(down_proj, SiluAndMul()(gate_up(x)), None)

    reference = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(partial(0, 1), reference)
    torch.testing.assert_close(partial(0, 2) + partial(1, 2), reference)
    torch.testing.assert_close(sum(partial(r, 3) for r in range(3)), reference)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_qkv_heads(tp_size: int) -> None:
    """4 query heads, 2 KV heads: tp 2 splits both; tp 4 replicates each KV head on two ranks."""
    from pagedllm.layers.linear import QKVParallelLinear

    heads, kv_heads, head_size, hidden = 4, 2, 3, 8
    gen = torch.Generator().manual_seed(1)
    wq = torch.randn(heads * head_size, hidden, generator=gen)
    wk, wv = (torch.randn(kv_heads * head_size, hidden, generator=gen) for _ in range(2))
    bq = torch.randn(heads * head_size, generator=gen)
    bk, bv = (torch.randn(kv_heads * head_size, generator=gen) for _ in range(2))
    x = torch.randn(2, hidden, generator=gen)
    q_full = (x @ wq.T + bq).view(2, heads, head_size)
    k_full = (x @ wk.T + bk).view(2, kv_heads, head_size)
    v_full = (x @ wv.T + bv).view(2, kv_heads, head_size)
    for rank in range(tp_size):
        layer = QKVParallelLinear(_tp_ctx(rank, tp_size), hidden, head_size, heads, kv_heads, bias=True)
        for param, tensors in ((layer.weight, (wq, wk, wv)), (layer.bias, (bq, bk, bv))):
            assert param is not None
            for shard, tensor in zip("qkv", tensors, strict=True):
                param.weight_loader(param, tensor, shard)
        per_rank, n = heads // tp_size, layer.num_kv_heads
        q, k, v = layer(x).split([per_rank * head_size, n * head_size, n * head_size], dim=-1)
        # The first KV head this rank holds: its own slice, or the head it shares with tp/kv_heads ranks.
        first_kv = rank * n if tp_size <= kv_heads else rank // (tp_size // kv_heads)
        torch.testing.assert_close(
            q.view(2, per_rank, head_size), q_full[:, rank * per_rank : (rank + 1) * per_rank]
        )
        torch.testing.assert_close(k.view(2, n, head_size), k_full[:, first_kv : first_kv + n])
        torch.testing.assert_close(v.view(2, n, head_size), v_full[:, first_kv : first_kv + n])


def test_tensor_parallel_vocab_padding() -> None:
    """Vocab 11 over 2 ranks: 6 rows each, the last row of rank 1 is zero padding; logits trim it."""
    from pagedllm.layers.embedding import ParallelLMHead

    full = torch.randn(11, 4, generator=torch.Generator().manual_seed(2))
    shards = []
    for rank in range(2):
        head = ParallelLMHead(_tp_ctx(rank, 2), 11, 4)
        head.weight.weight_loader(head.weight, full)
        shards.append(head.weight.data)
    assert shards[0].shape == (6, 4) and torch.equal(shards[1][5], torch.zeros(4))
    torch.testing.assert_close(torch.cat(shards)[:11], full)


@pytest.mark.parametrize("window, soft_cap", [(None, None), (3, None), (None, 2.0), (3, 2.0)])
def test_torch_backend_against_naive(window: int | None, soft_cap: float | None) -> None:
    """One decode and one chunk resuming a cached context, vs a per-token loop over the unpaged K/V."""
    from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
    from pagedllm.protocols.attention import AttentionLayerConfig
    from pagedllm.worker.input_prep import prepare_inputs

    heads, kv_heads, hd, bs = 4, 2, 8, 4
    gen = torch.Generator().manual_seed(3)
    lens, computed = [9, 7], [8, 2]  # request 0 decodes its 9th token; request 1 adds tokens 2..6
    ks = [torch.randn(n, kv_heads, hd, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, hd, generator=gen) for n in lens]
    qs = [torch.randn(n - c, heads, hd, generator=gen) for n, c in zip(lens, computed, strict=True)]
    cache = torch.zeros(TorchSDPABackend.kv_cache_shape(16, bs, kv_heads, hd))
    blocks = [[9, 3, 14], [6, 11]]
    # Earlier steps' K/V are already in the cache.
    for k, v, c, b in zip(ks, vs, computed, blocks, strict=True):
        for p in range(c):
            cache[0, b[p // bs], p % bs], cache[1, b[p // bs], p % bs] = k[p], v[p]
    step = prepare_inputs([[0] * n for n in lens], computed, [1, 5], blocks, bs, torch.device("cpu"), 1)
    impl = TorchSDPABackend.make_impl(AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, window, soft_cap))
    new = [slice(c, n) for n, c in zip(lens, computed, strict=True)]
    out = impl.forward(
        torch.cat(qs),
        torch.cat([k[s] for k, s in zip(ks, new, strict=True)]),
        torch.cat([v[s] for v, s in zip(vs, new, strict=True)]),
        cache,
        TorchSDPABackend.build_metadata(step.attn),
    )
    expected = []
    for q, k, v, c in zip(qs, ks, vs, computed, strict=True):
        for j in range(q.shape[0]):
            pos = c + j
            lo = 0 if window is None else max(0, pos - window + 1)
            kk = k[lo : pos + 1].repeat_interleave(2, dim=1)  # [ctx, heads, hd]
            scores = torch.einsum("hd,chd->hc", q[j], kk) * hd**-0.5
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            vv = v[lo : pos + 1].repeat_interleave(2, dim=1)
            expected.append(torch.einsum("hc,chd->hd", scores.softmax(-1), vv))
    torch.testing.assert_close(out, torch.stack(expected))
