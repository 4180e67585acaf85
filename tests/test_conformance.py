"""The conformance kit (pagedllm.testing) against the in-tree plugins and the example plugin package, and
proof that every check can fail: each kind is also fed a deliberately broken component.

Components are reached only through the plugin manager, by kind and registered name (a broken variant is a
subclass of what the manager resolves, registered for the test's duration with the kit's
`pagedllm_component` fixture): no plugin module is imported by its path, so this file keeps working while
plugins' files move. Shapes are tiny; the triton backend runs under its CPU interpreter in a child process
(TRITON_INTERPRET must be set before triton is first imported, see tests/test_triton_attention.py).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_example_plugins import installed  # noqa: F401  (the module-scoped fixture that pip-installs it)

from pagedllm.kv_cache.spec import FullAttentionSpec
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.plugin_spec import PluginKind
from pagedllm.testing import (
    NotApplicable,
    check_attention_backend,
    check_kv_manager,
    check_loader,
    check_model_architecture,
    check_quantization_method,
    check_scheduler,
    tiny_hf_config,
)
from pagedllm.testing.attention import DEFAULT_CASES

Register = Callable[..., Any]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on shared cores its spin-waits cost more than it
    computes (a tiny forward went from 1 ms to 0.3 s under load): one thread for this module's checks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _resolve(kind: PluginKind, name: str) -> Any:
    spec = get_plugin_manager().get(kind, name)
    assert spec is not None, f"{kind.value} {name!r} is not registered"
    return spec.resolve()


# -- the kit itself: packaging and fixtures ---------------------------------------------------------------------


def test_pytest_plugin_is_registered(request: pytest.FixtureRequest) -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert eps.get("pagedllm") == "pagedllm.testing.pytest_plugin", eps
    assert request.config.pluginmanager.has_plugin("pagedllm")  # pytest loaded it from the entry point


def test_pytest_plugin_import_does_not_import_torch() -> None:
    code = (
        "import sys, pagedllm.testing, pagedllm.testing.pytest_plugin\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy'))\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_fixtures(pagedllm_device: str, pagedllm_tiny_model: Callable[[str], str]) -> None:
    assert pagedllm_device == "cpu"
    folder = Path(pagedllm_tiny_model("llama"))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert pagedllm_tiny_model("llama") == str(folder)  # saved once per session


# -- attention backends -------------------------------------------------------------------------------------------


def test_torch_backend() -> None:
    report = check_attention_backend("torch")
    assert not report.skipped and report.max_rel_error == 0.0  # the reference against itself
    assert {"decode", "mixed_chunked", "mqa", "sliding_window", "soft_cap"} <= set(report.ran)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_backend_under_the_interpreter() -> None:
    code = (
        "import dataclasses, json\n"
        "from pagedllm.testing import check_attention_backend\n"
        "print(json.dumps(dataclasses.asdict(check_attention_backend('triton'))))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}  # one thread, as _one_thread says
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ran"] == [case.name for case in DEFAULT_CASES] and report["same_layout"], report


def _torch_subclass(**methods: Any) -> Any:
    """A subclass of the registered torch backend (it keeps the name "torch", so the torch registration's
    check applies to it), with `methods` replaced."""
    base = _resolve(PluginKind.ATTENTION, "torch")
    return type("BrokenTorchBackend", (base,), {k: staticmethod(v) for k, v in methods.items()})


def test_attention_check_catches_a_scaled_output() -> None:
    base = _resolve(PluginKind.ATTENTION, "torch")

    def make_impl(layer: Any) -> Any:
        impl = base.make_impl(layer)
        forward = impl.forward
        impl.forward = lambda *args: forward(*args) * 1.01
        return impl

    with pytest.raises(AssertionError, match=r"case 'prefill'.*output: max \|got - expected\|"):
        check_attention_backend(_torch_subclass(make_impl=make_impl))


def test_attention_check_catches_an_ignored_window() -> None:
    base = _resolve(PluginKind.ATTENTION, "torch")
    windowless = _torch_subclass(make_impl=lambda layer: base.make_impl(dataclasses.replace(layer, sliding_window=None)))
    with pytest.raises(AssertionError, match="case 'sliding_window'"):
        check_attention_backend(windowless)


def test_attention_check_catches_a_write_outside_the_step_slots() -> None:
    base = _resolve(PluginKind.ATTENTION, "torch")

    def make_impl(layer: Any) -> Any:
        impl = base.make_impl(layer)
        forward = impl.forward

        def clobbering(query: Any, key: Any, value: Any, kv_cache: Any, metadata: Any) -> Any:
            out = forward(query, key, value, kv_cache, metadata)
            kv_cache[:, 0] = 0  # also zeroes the null block: outputs unchanged, the cache is not
            return out

        impl.forward = clobbering
        return impl

    with pytest.raises(AssertionError, match=r"KV cache differs from the reference's in \d+ rows, first at K/V 0, block 0"):
        check_attention_backend(_torch_subclass(make_impl=make_impl))


def test_features_the_registration_refuses_are_skipped(pagedllm_component: Register) -> None:
    base = _resolve(PluginKind.ATTENTION, "torch")
    windowless = type("Windowless", (base,), {
        "name": "windowless",
        "make_impl": staticmethod(lambda layer: base.make_impl(dataclasses.replace(layer, sliding_window=None))),
    })

    def check(ctx: Any) -> list[str]:
        return ["no sliding window"] if ctx.sliding_window else []

    pagedllm_component(PluginKind.ATTENTION, "windowless", lambda: windowless, check=check, explicit_only=True)
    report = check_attention_backend("windowless")  # held only to what it claims: passes
    assert set(report.skipped) == {"sliding_window", "window_and_soft_cap"} and "soft_cap" in report.ran
    pagedllm_component(PluginKind.ATTENTION, "nothing_here", lambda: base, check=lambda ctx: ["not here"],
                       explicit_only=True)
    with pytest.raises(NotApplicable, match="refuses every case"):
        check_attention_backend("nothing_here")


# -- KV managers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["full_attention", "sliding_window", "mamba", "sink"])
def test_kv_manager(name: str) -> None:
    report = check_kv_manager(name)
    assert report.admissions > 50 and report.preemptions > 10
    assert (report.hit_blocks > 0) == (name != "mamba")  # Mamba states are never shared (no prefix caching)
    assert report.allocation_failures > 0 or name == "mamba"


def _full_attention_subclass(**methods: Any) -> Any:
    return type("BrokenManager", (_resolve(PluginKind.KV_MANAGER, "full_attention"),), methods)


def test_kv_check_catches_a_leaked_block(pagedllm_component: Register) -> None:
    def free(self: Any, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks[:-1]))  # the last block is never given back

    pagedllm_component(PluginKind.KV_MANAGER, "leaky", lambda: _full_attention_subclass(free=free))
    with pytest.raises(AssertionError, match=r"ref_cnt 1 but 0 running|leaked|still held"):
        check_kv_manager("leaky", FullAttentionSpec(4, 1, 8, torch.float32))


def test_kv_check_catches_an_unsound_prefix_hit(pagedllm_component: Register) -> None:
    def find_longest_cache_hit(self: Any, block_hashes: list[bytes], max_length: int) -> list[Any]:
        # Any cached blocks, whatever tokens they hold.
        cached = [b for entries in self.block_pool.cached_block_hash_to_block.values() for b in entries.values()]
        return cached[: min(len(block_hashes), max_length // self.block_size)]

    manager = _full_attention_subclass(find_longest_cache_hit=find_longest_cache_hit)
    pagedllm_component(PluginKind.KV_MANAGER, "careless", lambda: manager)
    with pytest.raises(AssertionError, match="a hit must be a full block whose tokens"):
        check_kv_manager("careless", FullAttentionSpec(4, 1, 8, torch.float32))


# -- schedulers -----------------------------------------------------------------------------------------------------


def test_fcfs_scheduler(pagedllm_tiny_model: Callable[[str], str]) -> None:
    report = check_scheduler("fcfs", model_dir=pagedllm_tiny_model("llama"))
    assert report.preemptions["preemption under a tiny KV pool"] > 0
    assert report.engine_compared_with is None  # the reference itself: nothing to compare with


def test_scheduler_check_catches_an_over_budget_step(pagedllm_component: Register) -> None:
    fcfs = _resolve(PluginKind.SCHEDULER, "fcfs")

    class OverBudget(fcfs):  # type: ignore[misc, valid-type]
        def schedule(self) -> Any:
            budget = self.config.max_num_batched_tokens
            self.config.max_num_batched_tokens = budget + 8  # plans with 8 tokens too many
            try:
                return super().schedule()
            finally:
                self.config.max_num_batched_tokens = budget

    pagedllm_component(PluginKind.SCHEDULER, "over_budget", lambda: OverBudget)
    with pytest.raises(AssertionError, match="over max_num_batched_tokens 16"):
        check_scheduler("over_budget", engine_run=False)


def test_scheduler_check_catches_a_repeated_token(pagedllm_component: Register) -> None:
    fcfs = _resolve(PluginKind.SCHEDULER, "fcfs")

    class Stuttering(fcfs):  # type: ignore[misc, valid-type]
        def preempt(self, request: Any) -> None:
            super().preempt(request)
            if request.output_token_ids:  # a preempted request comes back with its last token twice
                request.output_token_ids.append(request.output_token_ids[-1])

    pagedllm_component(PluginKind.SCHEDULER, "stuttering", lambda: Stuttering)
    with pytest.raises(AssertionError, match="tokens were lost, repeated or computed out of order"):
        check_scheduler("stuttering", engine_run=False)


# -- loaders --------------------------------------------------------------------------------------------------------


def test_hf_loader(pagedllm_tiny_model: Callable[[str], str]) -> None:
    from safetensors.torch import load_file

    folder = pagedllm_tiny_model("llama")
    report = check_loader("hf", folder, load_file(os.path.join(folder, "model.safetensors")))
    assert report.tensors_compared > 10 and report.max_abs_error == 0.0


def test_dummy_loader(pagedllm_tiny_model: Callable[[str], str]) -> None:
    # Random weights: no reference; every parameter filled, the same weights on a second load.
    assert check_loader("dummy", pagedllm_tiny_model("qwen3")).tensors_compared > 10


def test_loader_check_catches_a_wrong_tensor(
    pagedllm_component: Register, pagedllm_tiny_model: Callable[[str], str]
) -> None:
    from safetensors.torch import load_file

    class Perturbed(_resolve(PluginKind.LOADER, "hf")):  # type: ignore[misc]
        def load_weights(self, module: Any, model: str, info: Any) -> None:
            super().load_weights(module, model, info)
            with torch.no_grad():
                dict(module.named_parameters())["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3

    pagedllm_component(PluginKind.LOADER, "perturbed", lambda: Perturbed, explicit_only=True)
    folder = pagedllm_tiny_model("llama")
    with pytest.raises(AssertionError, match=r"1 tensors differ.*down_proj.weight: max \|got - expected\| = 0.001"):
        check_loader("perturbed", folder, load_file(os.path.join(folder, "model.safetensors")))


GGUF_TINY = dict(vocab=96, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2)
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    stem, suffix = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[stem]}.{suffix}"


def _write_tiny_gguf(path: Path) -> dict[str, torch.Tensor]:
    """A llama GGUF as llama.cpp's converter writes one (q/k rows permuted; Q8_0, F16 and F32 tensors);
    returns what it decodes to in Hugging Face naming -- gguf-py's own dequantization of the stored blocks."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    t = GGUF_TINY
    rng = np.random.default_rng(0)
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((t["vocab"], t["hidden"])),
                                 "model.norm.weight": rng.standard_normal(t["hidden"]),
                                 "lm_head.weight": rng.standard_normal((t["vocab"], t["hidden"]))}
    head = t["hidden"] // t["heads"]
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (t["heads"] * head, t["hidden"])),
                            ("self_attn.k_proj", (t["kv_heads"] * head, t["hidden"])),
                            ("self_attn.v_proj", (t["kv_heads"] * head, t["hidden"])),
                            ("self_attn.o_proj", (t["hidden"], t["heads"] * head)),
                            ("mlp.gate_proj", (t["ffn"], t["hidden"])), ("mlp.up_proj", (t["ffn"], t["hidden"])),
                            ("mlp.down_proj", (t["hidden"], t["ffn"])), ("input_layernorm", (t["hidden"],)),
                            ("post_attention_layernorm", (t["hidden"],))):
            hf[p + name + ".weight"] = rng.standard_normal(shape)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(t["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_freq_base(1e4)
    writer.add_layer_norm_rms_eps(1e-6)
    decoded: dict[str, torch.Tensor] = {}
    for name, value in hf.items():
        value = value.astype(np.float32)
        qtype = Q.F32 if value.ndim == 1 else Q.F16 if "v_proj" in name else Q.Q8_0
        stored = value
        if "q_proj" in name or "k_proj" in name:  # llama.cpp's rotary permutation of q/k rows
            n = t["heads"] if "q_proj" in name else t["kv_heads"]
            stored = value.reshape(n, 2, -1, value.shape[1]).swapaxes(1, 2).reshape(value.shape)
        if qtype == Q.F32:
            writer.add_tensor(_gguf_name(name), stored)
        elif qtype == Q.F16:
            writer.add_tensor(_gguf_name(name), stored.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        # Blocks run along rows, so the permuted rows' round trip is the original rows' round trip.
        roundtrip = value.astype(np.float16) if qtype == Q.F16 else value if qtype == Q.F32 else (
            gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype))
        decoded[name] = torch.from_numpy(np.asarray(roundtrip, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed")
def test_gguf_loader(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    reference = _write_tiny_gguf(path)
    report = check_loader("gguf", str(path), reference)
    assert report.architecture == "LlamaForCausalLM" and report.max_abs_error == 0.0


# -- quantization methods --------------------------------------------------------------------------------------------


def test_unquantized_method() -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    check_quantization_method("none", {"weight": w}, w, bias=torch.randn(48))
    check_quantization_method("none", [{"weight": w[:16]}, {"weight": w[16:]}], [w[:16], w[16:]])


def test_awq_and_gptq_methods() -> None:
    from quant_packers import awq_pack, gptq_pack, quantize_rtn

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    ql = quantize_rtn(w, 4, 32, sym=False, act_order=False)
    qweight, qzeros = awq_pack(ql.q, ql.z)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    check_quantization_method("awq", {"qweight": qweight, "qzeros": qzeros, "scales": ql.s}, ql.dense(),
                              quantization_config=awq)
    for bits, sym, act_order, v1 in ((4, True, True, True), (8, False, False, False)):
        ql = quantize_rtn(w, bits, 32, sym=sym, act_order=act_order, min_zero=1 if v1 else 0)
        qweight, qzeros = gptq_pack(ql.q, ql.z, bits, v1=v1)
        gptq = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if v1 else "gptq_v2"}
        checkpoint = {"qweight": qweight, "qzeros": qzeros, "scales": ql.s, "g_idx": ql.g_idx}
        check_quantization_method("gptq", checkpoint, ql.dense(), quantization_config=gptq)


def test_fp8_method() -> None:
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    pieces, dense = [], []
    for w in (w1, w2):  # a checkpoint: e4m3 codes and one scale per tensor, fused as two pieces
        scale = w.abs().max() / 448
        codes = (w / scale).to(torch.float8_e4m3fn)
        pieces.append({"weight": codes, "weight_scale": scale.reshape(())})
        dense.append(codes.float() * scale)
    check_quantization_method("fp8", pieces, dense, quantization_config=fp8)
    # On the fly (no quantization_config): float weights in, one scale per output row, 448 at the row's max.
    rows = w1.abs().amax(1, keepdim=True) / 448
    check_quantization_method("fp8", {"weight": w1}, (w1 / rows).to(torch.float8_e4m3fn).float() * rows)


def test_compressed_tensors_fp8_method() -> None:
    """A compressed-tensors `float-quantized` checkpoint (FP8 weights, one scale per output channel, dynamic
    per-token activations), laid out as llm-compressor writes them."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen)
    scale = w.abs().amax(1, keepdim=True) / 448
    codes = (w / scale).to(torch.float8_e4m3fn)
    config = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
    }
    # On the CPU the method multiplies float activations by the dequantized weights (no FP8 GEMM there), so
    # the product is exact to the kit's default tolerance.
    check_quantization_method("compressed-tensors", {"weight": codes, "weight_scale": scale}, codes.float() * scale,
                              quantization_config=config)


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed")
def test_gguf_method() -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    from pagedllm.formats.gguf_blocks import GGUFBlocks

    rng = np.random.default_rng(0)
    pieces, dense = [], []
    for rows, qtype in ((64, Q.Q8_0), (32, Q.Q4_0), (32, Q.Q5_1)):  # one fused layer mixing block types
        w = rng.standard_normal((rows, 128)).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
        pieces.append({"weight": GGUFBlocks(torch.from_numpy(raw.reshape(rows, -1).copy()), qtype, (rows, 128))})
        dense.append(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, 128)))
    # Some CPU kernels multiply bfloat16 (or int16-rounded) activations: ~2^-8 relative.
    check_quantization_method("gguf", pieces, dense, quantization_config={}, rtol=2e-2)


def test_quantization_check_catches_a_wrong_product(pagedllm_component: Register) -> None:
    none = _resolve(PluginKind.QUANTIZATION, "none")

    class Off(none):  # type: ignore[misc, valid-type]
        def get_method(self, layer: Any, prefix: str) -> Any:
            method = super().get_method(layer, prefix)
            apply = method.apply
            method.apply = lambda layer, x, bias: apply(layer, x, bias) * 1.01  # type: ignore[method-assign]
            return method

    pagedllm_component(PluginKind.QUANTIZATION, "off_by_one_percent", lambda: Off)
    w = torch.randn(48, 64)
    with pytest.raises(AssertionError, match=r"1 rows: x @ W\^T: max \|got - expected\|"):
        check_quantization_method("off_by_one_percent", {"weight": w}, w)


# -- model architectures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "arch"), [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                            ("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM"),
                                            ("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
                                            ("gpt_oss", "GptOssForCausalLM"), ("mamba", "MambaForCausalLM"),
                                            ("mamba2", "Mamba2ForCausalLM"), ("bamba", "BambaForCausalLM")])
def test_model_architecture(kind: str, arch: str) -> None:
    report = check_model_architecture(arch, tiny_hf_config(kind))
    assert report.new_tokens == 8 and max(report.prompt_lengths) > 8  # past gemma2's window of 8


def test_model_check_catches_wrong_logits(pagedllm_component: Register) -> None:
    llama = _resolve(PluginKind.MODEL, "LlamaForCausalLM")

    class Shifted(llama):  # type: ignore[misc, valid-type]
        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return torch.roll(super().compute_logits(hidden_states), 1, dims=-1)  # every id one place on

    pagedllm_component(PluginKind.MODEL, "ShiftedLlamaForCausalLM", lambda: Shifted)
    with pytest.raises(AssertionError, match="ShiftedLlamaForCausalLM.*first difference at step 0"):
        check_model_architecture("ShiftedLlamaForCausalLM", tiny_hf_config("llama"), prompts=[[5, 6, 7]],
                                 max_new_tokens=2)


# -- the example plugin package (pip-installed by test_example_plugins' fixture) ------------------------------------


def test_example_attention_backend(installed: Path) -> None:  # noqa: F811
    pm = PluginManager()  # discovers what is installed now, the example package included
    report = check_attention_backend("stats_torch", plugin_manager=pm)
    assert not report.skipped and report.max_rel_error == 0.0


def test_example_scheduler(installed: Path, pagedllm_tiny_model: Callable[[str], str]) -> None:  # noqa: F811
    report = check_scheduler("spf", plugin_manager=PluginManager(), model_dir=pagedllm_tiny_model("llama"))
    assert report.engine_compared_with == "fcfs" and report.preemptions["preemption under a tiny KV pool"] > 0
