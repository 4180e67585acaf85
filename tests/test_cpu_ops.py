"""The fused CPU ops (the gguf plugin's cpu_ops.c) against the layers' own torch code, the reference.

Each layer is run twice on the same input, once with `cpu_ops` handed to it (as the engine builder does for
a kept-quantized model) and once without. Rotary is bit-identical (cpu_ops.c NOTE 1); the norm, SiLU and
attention sum in another order or use libm's expf, so they are compared within float32 rounding. The
engine switch: a kept-quantized GGUF model gets the ops, the dense (default) CPU path never does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_ops import building
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.plugins.quantization.gguf import cpu_ops as cpu_ops_module
from pagedllm.plugins.quantization.gguf.cpu_ops import cpu_ops
from pagedllm.protocols.attention import AttentionLayerConfig
from pagedllm.protocols.model import KernelOptions
from pagedllm.worker.input_prep import prepare_inputs


@pytest.fixture(scope="module")
def ops() -> Any:
    lib = cpu_ops()
    if lib is None:
        pytest.skip(f"cpu_ops.c unavailable: {cpu_ops_module.unavailable_reason()}")
    return lib


def _pair(module: Any, ops: Any) -> tuple[Any, Any]:
    """`module` with the C ops, and the same module object's torch path (a function switching it)."""

    def torch_path(*args: Any) -> Any:
        module.cpu_ops = None
        try:
            return module(*args)
        finally:
            module.cpu_ops = ops

    module.cpu_ops = ops
    return module, torch_path


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 4, 64), (2, 20)])
def test_add_rms_norm(ops: Any, norm_cls: type[RMSNorm], shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = norm_cls(shape[-1], eps=1e-5)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    fused, reference = _pair(norm, ops)
    x, res = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    torch.testing.assert_close(fused(x), reference(x), rtol=2e-6, atol=1e-6)
    out, new_res = fused(x, res)
    ref_out, ref_res = reference(x, res)
    assert torch.equal(new_res, ref_res)  # the residual add is one float add either way
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=1e-6)
    strided = torch.randn(shape[0], 2 * shape[-1], generator=gen)[:, : shape[-1]] if len(shape) == 2 else x
    torch.testing.assert_close(fused(strided), reference(strided), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_bit_identical(ops: Any, rotary_dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, rotary_dim, 256, 10000.0)
    fused, reference = _pair(rope, ops)
    qkv = torch.randn(5, (9 + 3 + 3) * 64, generator=gen)
    positions = torch.tensor([0, 7, 100, 255, 3])
    ref_q, ref_k = reference(positions, *qkv.clone().split([9 * 64, 3 * 64, 3 * 64], dim=-1)[:2])
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided views into one qkv row, as in a model
    v_before = v.clone()
    got_q, got_k = fused(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(v, v_before)


def test_gptj_rotary_keeps_torch_path(ops: Any) -> None:
    rope = RotaryEmbedding(16, 16, 32, 10000.0, is_neox_style=False)
    fused, reference = _pair(rope, ops)
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    positions = torch.tensor([1, 2, 3])
    got = fused(positions, q.clone(), k.clone())
    ref = reference(positions, q.clone(), k.clone())
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("shape", [(1, 3072), (6, 40), (2, 3, 8)])
def test_silu_and_mul(ops: Any, shape: tuple[int, ...]) -> None:
    fused, reference = _pair(SiluAndMul(), ops)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 4
    torch.testing.assert_close(fused(x), reference(x), rtol=2e-6, atol=1e-6)


def test_silu_and_mul_over_the_whole_float_range(ops: Any) -> None:
    """The vectorized exp (cpu_ops.c NOTE 4) at both clamps and across the range, against torch's silu."""
    fused, reference = _pair(SiluAndMul(), ops)
    gate = torch.cat([torch.linspace(-120, 120, 2999), torch.tensor([0.0, -1e-30, 88.5, -88.5, 200.0])])
    x = torch.cat([gate, torch.linspace(-3, 3, gate.numel())]).unsqueeze(0)
    torch.testing.assert_close(fused(x), reference(x), rtol=1e-6, atol=1e-30)


def _decode_step(lens: list[int], blocks: list[list[int]], bs: int) -> Any:
    """A decode-only step: request i decodes its lens[i]-th token (the earlier ones are cached)."""
    step = prepare_inputs([[0] * n for n in lens], [n - 1 for n in lens], [1] * len(lens), blocks, bs,
                          torch.device("cpu"), len(lens))
    return step.attn


def _threaded_batch(seed: int) -> tuple[Any, ...]:
    """12 decode requests of 200-343 tokens (9 heads, 3 KV heads, head size 64, blocks of 16): ~3.2M
    multiply-adds, past the 2^20 at which the kernel shares requests out over threads (cpu_ops.c NOTE 6).
    Returns (common metadata, a random float32 cache, q, k, v, slots, block table, seq lens)."""
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(seed)
    lens = [200 + 13 * i for i in range(12)]
    assert sum(lens) * heads * hd >= 1 << 20
    blocks, next_block = [], 1
    for n in lens:
        count = -(-n // bs)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    cache = torch.randn(TorchSDPABackend.kv_cache_shape(next_block, bs, kv_heads, hd), generator=gen)
    q = torch.randn(len(lens), heads, hd, generator=gen)
    k, v = torch.randn(len(lens), kv_heads, hd, generator=gen), torch.randn(len(lens), kv_heads, hd, generator=gen)
    common = _decode_step(lens, blocks, bs)
    slots = common.slot_mapping.to(torch.int64).contiguous()
    table = common.block_table.to(torch.int32).contiguous()
    seq_lens = common.seq_lens_cpu.to(torch.int32).contiguous()
    return common, cache, q, k, v, slots, table, seq_lens



@pytest.mark.parametrize("window, soft_cap", [(None, None), (5, None), (None, 30.0)])
def test_decode_attention(ops: Any, window: int | None, soft_cap: float | None) -> None:
    heads, kv_heads, hd, bs = 9, 3, 64, 4
    gen = torch.Generator().manual_seed(3)
    lens = [9, 1, 14]
    blocks = [[9, 3, 14], [6], [2, 11, 4, 7]]  # not consecutive: read through the block table
    cache = torch.randn(TorchSDPABackend.kv_cache_shape(16, bs, kv_heads, hd), generator=gen)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * hd, generator=gen)
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k, v = q.reshape(-1, heads, hd), k.reshape(-1, kv_heads, hd), v.reshape(-1, kv_heads, hd)
    layer = AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, window, soft_cap)
    reference = TorchSDPABackend.make_impl(layer)
    fused = TorchSDPABackend.make_impl(layer)
    fused.cpu_ops = ops
    common = _decode_step(lens, blocks, bs)
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = reference.forward(q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    md = TorchSDPABackend.build_metadata(common)
    got = fused.forward(q, k, v, got_cache, md)
    assert md.c_decode  # the C kernel took the step
    assert torch.equal(got_cache, ref_cache)  # the new K/V rows written at the same slots
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "bs"), [(16, 2, 16), (10, 2, 6), (4, 4, 5), (12, 4, 8)])
def test_decode_attention_any_group_and_page_size(ops: Any, heads: int, kv_heads: int, bs: int) -> None:
    """GQA groups of 8, 5 (four query heads and one), 1 and 3 on a KV head (the scores are taken up to four query
    heads at a time, cpu_ops.c NOTE 11), and page sizes that are not powers of two (the division path)."""
    hd = 64
    gen = torch.Generator().manual_seed(heads * 100 + bs)
    lens = [61, 3, 30]
    order = torch.randperm(40, generator=gen) + 1
    blocks, used = [], 0
    for n in lens:
        count = -(-n // bs)
        blocks.append(order[used : used + count].tolist())
        used += count
    cache = torch.randn(TorchSDPABackend.kv_cache_shape(41, bs, kv_heads, hd), generator=gen)
    q = torch.randn(len(lens), heads, hd, generator=gen)
    k, v = torch.randn(len(lens), kv_heads, hd, generator=gen), torch.randn(len(lens), kv_heads, hd, generator=gen)
    layer = AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, None, None)
    reference, fused = TorchSDPABackend.make_impl(layer), TorchSDPABackend.make_impl(layer)
    fused.cpu_ops = ops
    common = _decode_step(lens, blocks, bs)
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = reference.forward(q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    md = TorchSDPABackend.build_metadata(common)
    got = fused.forward(q, k, v, got_cache, md)
    assert md.c_decode
    assert torch.equal(got_cache, ref_cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_norm_and_rotary_on_threads_keep_every_bit(ops: Any) -> None:
    """A prefill chunk's rows (past cpu_ops.c's MT_MIN_ELEMS) shared over threads: the one-thread bits (NOTE 12)."""
    gen = torch.Generator().manual_seed(12)
    x, res, w = torch.randn(600, 576, generator=gen), torch.randn(600, 576, generator=gen), torch.randn(576, generator=gen)
    rope = RotaryEmbedding(64, 64, 4096, 10000.0)
    qkv = torch.randn(600, 15 * 64, generator=gen)
    positions = torch.randint(0, 4096, (600,), generator=gen)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            q, k, _ = qkv.clone().split([9 * 64, 3 * 64, 3 * 64], dim=-1)
            ops.rotary_neox(positions, q, k, rope.cos_cache, rope.sin_cache, 64)
            got.append((*ops.add_rms_norm(x, res, w, 1e-5, False), q, k))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1], strict=True))


def test_decode_attention_over_long_scattered_contexts(ops: Any) -> None:
    """Contexts of many blocks in any order, longer than the rows the kernel reads ahead (cpu_ops.c NOTE 3),
    SmolLM2's heads (9 query heads on 3 KV heads), against the torch backend's own decode."""
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(5)
    lens = [300, 5, 77]
    order = torch.randperm(63, generator=gen) + 1  # block 0 is the null block
    blocks, used = [], 0
    for n in lens:
        count = -(-n // bs)
        blocks.append(order[used : used + count].tolist())
        used += count
    cache = torch.randn(TorchSDPABackend.kv_cache_shape(64, bs, kv_heads, hd), generator=gen)
    q = torch.randn(len(lens), heads, hd, generator=gen)
    k, v = torch.randn(len(lens), kv_heads, hd, generator=gen), torch.randn(len(lens), kv_heads, hd, generator=gen)
    layer = AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, None, None)
    reference, fused = TorchSDPABackend.make_impl(layer), TorchSDPABackend.make_impl(layer)
    fused.cpu_ops = ops
    common = _decode_step(lens, blocks, bs)
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = reference.forward(q, k, v, ref_cache, TorchSDPABackend.build_metadata(common))
    md = TorchSDPABackend.build_metadata(common)
    got = fused.forward(q, k, v, got_cache, md)
    assert md.c_decode
    assert torch.equal(got_cache, ref_cache)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_mixed_step_keeps_torch_path(ops: Any) -> None:
    """A step with a prefill in it goes through the torch code (the C kernel takes decode-only steps)."""
    heads, kv_heads, hd, bs = 4, 2, 8, 4
    layer = AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, None, None)
    impl, reference = TorchSDPABackend.make_impl(layer), TorchSDPABackend.make_impl(layer)
    impl.cpu_ops = ops
    step = prepare_inputs([[0] * 9, [0] * 7], [8, 2], [1, 5], [[9, 3, 14], [6, 11]], bs, torch.device("cpu"), 1)
    md = TorchSDPABackend.build_metadata(step.attn)
    cache = torch.randn(TorchSDPABackend.kv_cache_shape(16, bs, kv_heads, hd))
    qkv = torch.randn(6, heads, hd), torch.randn(6, kv_heads, hd), torch.randn(6, kv_heads, hd)
    got = impl.forward(*qkv, cache.clone(), md)
    assert md.c_decode is False
    assert torch.equal(got, reference.forward(*qkv, cache.clone(), TorchSDPABackend.build_metadata(step.attn)))


def test_the_build_hands_cpu_ops_to_layers_and_attention(ops: Any) -> None:
    """Layers built inside `building(KernelOptions(cpu_ops=...))` take the ops at construction, and so does an
    attention impl through its layer config; layers built outside get none (two engines may differ)."""
    layer = AttentionLayerConfig(2, 8, 1, 1.0, None, None, cpu_ops=ops)
    with building(KernelOptions(cpu_ops=ops)):
        norm, act = RMSNorm(8), SiluAndMul()
        impl = TorchSDPABackend.make_impl(layer)
    assert norm.cpu_ops is ops and act.cpu_ops is ops and impl.cpu_ops is ops
    assert RMSNorm(8).cpu_ops is None and SiluAndMul().cpu_ops is None
    assert TorchSDPABackend.make_impl(AttentionLayerConfig(2, 8, 1, 1.0, None, None)).cpu_ops is None


def test_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_OPS", "0")
    cpu_ops.cache_clear()
    try:
        assert cpu_ops() is None
        assert cpu_ops_module.unavailable_reason() == "PAGEDLLM_CPU_OPS=0"
    finally:
        cpu_ops.cache_clear()


def test_decode_attention_on_threads_keeps_every_bit(ops: Any) -> None:
    """A batch large enough to share its requests out over threads (cpu_ops.c NOTE 6: >= 2^20 multiply-adds)
    gives the one-thread result bit for bit, and the same as the torch backend's decode."""
    heads, kv_heads, hd = 9, 3, 64
    common, cache, q, k, v, slots, table, seq_lens = _threaded_batch(seed=11)
    outs, caches = [], []
    for threads in (1, 2, 3):
        c = cache.clone()
        outs.append(ops.decode_attention(q, k, v, c, slots, table, seq_lens, hd**-0.5, None, None, threads=threads))
        caches.append(c)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(caches[0], caches[1])
    reference = TorchSDPABackend.make_impl(AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, None, None))
    ref = reference.forward(q, k, v, cache.clone(), TorchSDPABackend.build_metadata(common))
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


# -- the bf16 GEMM path's helpers (cpu_ops.c NOTE 7, 8) --------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 3072), (2048, 3072), (5, 46)])  # one thread, rows on threads, a tail
def test_silu_and_mul_bf16_rounds_the_float32_product_once(ops: Any, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    x[0, 0], x[0, shape[1] // 2] = float("nan"), 1.0  # NaN gate: NaN out
    gate, up = x.float().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    got = ops.silu_and_mul_bf16(x)
    assert got.dtype == torch.bfloat16 and got.shape == (shape[0], shape[1] // 2) and got[0, 0].isnan()
    got, exact = got.float()[:, 1:], exact[:, 1:]
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()  # within one bf16 rounding
    assert (got == exact.to(torch.bfloat16).float()).float().mean() > 0.99  # our exp: 1-2 float32 ulp


def test_silu_and_mul_bf16_keeps_its_bits_on_threads(ops: Any) -> None:
    x = torch.randn(2048, 3072, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.silu_and_mul_bf16(x)
        torch.set_num_threads(2)
        assert torch.equal(ops.silu_and_mul_bf16(x), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("rows", "n", "k"), [(32, 49152, 8), (3, 9, 8), (1, 100, 1), (2, 17, 17)])
def test_top_k_picks_what_topk_picks(ops: Any, rows: int, n: int, k: int) -> None:
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n))
    x[0, 3] = float("nan")  # never picked
    got = ops.top_k(x, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    clean = x.nan_to_num(nan=-float("inf"))
    want = clean.topk(k, dim=-1).indices
    # No set order; values compared, so a tie could take either index.
    assert torch.equal(clean.gather(1, got).sort(dim=-1).values, clean.gather(1, want).sort(dim=-1).values)
    assert all(len(set(r.tolist())) == k for r in got)


def test_top_k_refuses_a_k_it_cannot_hold(ops: Any) -> None:
    for k in (0, 65, 11):
        with pytest.raises(ValueError, match="cpu_top_k"):
            ops.top_k(torch.zeros(2, 10), k)


# -- a bf16 KV cache (cpu_ops.c NOTE 9) ------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [[], ["-march=x86-64"]])  # native (AVX2 lanes), and the plain C path
def test_decode_attention_over_a_bf16_cache(ops: Any, flags: list[str]) -> None:
    """The decode kernel on a bf16 cache: the new K/V rows written rounded as torch rounds them, the output bit
    for bit the float32 kernel's on a float32 cache of the same rounded values, within float32 rounding of the
    torch backend's float32 decode over those values -- on threads, and built without AVX2."""
    from pagedllm.api.kernels import load_native

    kernel = ops
    if flags:
        lib, why = load_native(cpu_ops_module.SOURCE, [f for f in cpu_ops_module.FLAGS if f != "-march=native"] + flags,
                               "PAGEDLLM_CPU_OPS", "nothing")
        assert lib is not None, why
        kernel = cpu_ops_module.CpuOps(lib)
    heads, kv_heads, hd = 9, 3, 64
    common, cache, q, k, v, slots, table, seq_lens = _threaded_batch(seed=13)
    bf16, f32 = cache.to(torch.bfloat16), cache.to(torch.bfloat16).float()
    kr, vr = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    got = kernel.decode_attention(q, k, v, bf16, slots, table, seq_lens, hd**-0.5, None, None, threads=2)
    same = kernel.decode_attention(q, kr, vr, f32, slots, table, seq_lens, hd**-0.5, None, None, threads=1)
    assert torch.equal(bf16.float(), f32)  # the new rows rounded to nearest even, at the same slots
    assert torch.equal(got, same)
    layer = AttentionLayerConfig(heads, hd, kv_heads, hd**-0.5, None, None)
    ref = TorchSDPABackend.make_impl(layer).forward(q, kr, vr, f32.clone(), TorchSDPABackend.build_metadata(common))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.decode_attention(q, k, v, cache.half(), slots, table, seq_lens, hd**-0.5, None, None)
