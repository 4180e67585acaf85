"""MoE layers (pagedllm.layers.moe): the fused-MoE torch reference against a dense per-token computation and
against transformers' own expert modules (Mixtral's SwiGLU experts, gpt-oss's clamped ones), the two routers
against transformers' routers, the op's argument checks, and tensor-parallel sharding of the expert weights
(each rank's partial sum adds up to the unsharded layer)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedllm.api.model import (
    FusedMoE,
    ModelBuildContext,
    fused_moe,
    fused_moe_reference,
    softmax_topk,
    topk_softmax,
)
from pagedllm.plugins.models.gpt_oss.model import to_fused_moe_layout

T, H, N, E, K = 13, 32, 24, 6, 2


def _inputs(seed: int, dtype: torch.dtype = torch.float32, bias: bool = True) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    weights, ids = softmax_topk(logits, K)
    return dict(
        hidden=torch.randn(T, H, generator=g).to(dtype),
        w13=(torch.randn(E, 2 * N, H, generator=g) * 0.3).to(dtype),
        w2=(torch.randn(E, H, N, generator=g) * 0.3).to(dtype),
        topk_weights=weights,
        topk_ids=ids,
        w13_bias=(torch.randn(E, 2 * N, generator=g) * 0.5).to(dtype) if bias else None,
        w2_bias=(torch.randn(E, H, generator=g) * 0.5).to(dtype) if bias else None,
    )


def _dense(args: dict[str, Any], activation: str, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the formula the op's docstring states, nothing shared."""
    hidden, w13, w2 = args["hidden"].double(), args["w13"].double(), args["w2"].double()
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(args["topk_ids"][t, k])
            gate_up = w13[e] @ hidden[t]
            if args["w13_bias"] is not None:
                gate_up = gate_up + args["w13_bias"][e].double()
            gate, up = gate_up[:N], gate_up[N:]
            if activation == "silu":
                act = gate * torch.sigmoid(gate) * up
            elif activation == "gelu":
                act = 0.5 * gate * (1 + torch.erf(gate / 2**0.5)) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            y = w2[e] @ act
            if args["w2_bias"] is not None:
                y = y + args["w2_bias"][e].double()
            out[t] += float(args["topk_weights"][t, k]) * y
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
@pytest.mark.parametrize("bias", [True, False])
def test_reference_equals_the_dense_per_token_sum(activation: str, bias: bool) -> None:
    args = _inputs(1, bias=bias)
    out = fused_moe_reference(**args, activation=activation)
    assert out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _dense(args, activation), rtol=1e-5, atol=1e-5)


def test_swigluoai_limit_and_alpha_are_applied() -> None:
    args = _inputs(2)
    args["hidden"] = args["hidden"] * 8  # large pre-activations: the clamp decides many of them
    out = fused_moe_reference(**args, activation="swigluoai", swiglu_limit=1.5, swiglu_alpha=0.9)
    torch.testing.assert_close(out.double(), _dense(args, "swigluoai", 1.5, 0.9), rtol=1e-5, atol=1e-4)
    default = fused_moe_reference(**args, activation="swigluoai")
    assert not torch.allclose(out, default)  # the arguments reach the computation


def test_bfloat16_stays_close_to_float64() -> None:
    args = _inputs(3, dtype=torch.bfloat16)
    out = fused_moe_reference(**args, activation="silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _dense(args, "silu"), rtol=2e-2, atol=5e-2)


def test_tokens_routed_nowhere_and_empty_batches() -> None:
    args = _inputs(4)
    args["topk_ids"] = torch.zeros_like(args["topk_ids"])
    args["topk_ids"][:, 1] = 3  # every token on experts 0 and 3; the rest see no tokens
    torch.testing.assert_close(fused_moe_reference(**args).double(), _dense(args, "silu"), rtol=1e-5, atol=1e-5)
    empty = fused_moe_reference(
        torch.zeros(0, H), args["w13"], args["w2"], torch.zeros(0, K), torch.zeros(0, K, dtype=torch.int32)
    )
    assert empty.shape == (0, H)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"activation": "relu"}, "activation 'relu' is not supported"),
        ({"activation": "silu", "swiglu_limit": 7.0}, "swigluoai"),
        ({"activation": "gelu", "swiglu_alpha": 1.0}, "swigluoai"),
        ({"topk_weights": torch.ones(T, K, dtype=torch.float16)}, "topk_weights must be float32"),
        ({"topk_ids": torch.zeros(T, K, dtype=torch.int64)}, "topk_ids must be int32"),
        ({"topk_ids": torch.zeros(T, K + 1, dtype=torch.int32)}, r"\[T=13, K\]"),
        ({"w2": torch.zeros(E, H, N + 1)}, "do not fit"),
        ({"w13_bias": torch.zeros(E, N)}, "w13_bias"),
        ({"w2_bias": torch.zeros(E + 1, H)}, "w2_bias"),
    ],
)
def test_bad_arguments_are_named(change: dict[str, Any], match: str) -> None:
    args = {**_inputs(5), **change}
    with pytest.raises(ValueError, match=match):
        fused_moe_reference(**args)


def test_fused_moe_runs_the_reference_on_the_cpu() -> None:
    args = _inputs(6)
    assert torch.equal(fused_moe(**args, activation="gelu"), fused_moe_reference(**args, activation="gelu"))


# -- against transformers ----------------------------------------------------------------------------------------


def _eager(module: Any) -> Any:
    """transformers' per-expert loop, not a kernel it may dispatch to."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return module


def test_softmax_topk_and_experts_equal_mixtral() -> None:
    import transformers
    from transformers.models.mixtral import modeling_mixtral as mm

    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=N, num_local_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    router, experts = mm.MixtralTopKRouter(cfg), _eager(mm.MixtralExperts(cfg))
    for p in (router.weight, experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(T, H)
    with torch.no_grad():
        _, hf_scores, hf_ids = router(x)
        expected = experts(x, hf_ids, hf_scores)
        weights, ids = softmax_topk(F.linear(x, router.weight), K)
        assert torch.equal(ids.long(), hf_ids) and ids.dtype == torch.int32
        torch.testing.assert_close(weights, hf_scores, rtol=0, atol=0)
        # Mixtral's gate_up_proj [E, 2I, H] is the op's w13 layout already.
        out = fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids, "silu")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_topk_softmax_and_swigluoai_experts_equal_gpt_oss() -> None:
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss as gm

    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=N, num_local_experts=E, num_experts_per_tok=K)
    torch.manual_seed(1)
    router, experts = gm.GptOssTopKRouter(cfg), _eager(gm.GptOssExperts(cfg))
    for p in (router.weight, router.bias, experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
              experts.down_proj_bias):
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(T, H) * 3  # wide enough that the clamps at +-7 bite
    with torch.no_grad():
        _, hf_scores, hf_ids = router(x)
        expected = experts(x, hf_ids, hf_scores)
        weights, ids = topk_softmax(F.linear(x, router.weight, router.bias), K)
        assert torch.equal(ids.long(), hf_ids)
        torch.testing.assert_close(weights, hf_scores, rtol=0, atol=0)
        prefix = "model.layers.0.mlp.experts."
        converted = dict(to_fused_moe_layout([
            (prefix + "gate_up_proj", experts.gate_up_proj), (prefix + "gate_up_proj_bias", experts.gate_up_proj_bias),
            (prefix + "down_proj", experts.down_proj), (prefix + "down_proj_bias", experts.down_proj_bias),
        ]))
        out = fused_moe_reference(
            x, converted[prefix + "w13_weight"], converted[prefix + "w2_weight"], weights, ids, "swigluoai",
            converted[prefix + "w13_bias"], converted[prefix + "w2_bias"], cfg.swiglu_limit, cfg.swiglu_alpha,
        )
        interleaved = fused_moe_reference(  # the checkpoint's layout taken as [gate | up]: must not match
            x, experts.gate_up_proj.transpose(1, 2), converted[prefix + "w2_weight"], weights, ids, "swigluoai",
            experts.gate_up_proj_bias, converted[prefix + "w2_bias"],
        )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(interleaved, expected, atol=1e-2)


# -- the layer: loading and tensor-parallel shards ---------------------------------------------------------------


def _ctx(tp_rank: int, tp_size: int) -> ModelBuildContext:
    return ModelBuildContext(None, torch.float32, torch.device("cpu"), None, None, 16, tp_rank, tp_size)


def _layer(tp_rank: int, tp_size: int, args: dict[str, Any]) -> FusedMoE:
    layer = FusedMoE(_ctx(tp_rank, tp_size), E, K, H, N, bias=True, activation="swigluoai", prefix="moe")
    for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
        param = getattr(layer, name)
        param.weight_loader(param, args[name.replace("_weight", "")])
    return layer


def test_layer_loads_full_tensors_and_tp_shards_sum_to_the_whole() -> None:
    args = _inputs(7)
    whole = _layer(0, 1, args)
    expected = fused_moe_reference(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"],
                                   "swigluoai", args["w13_bias"], args["w2_bias"])
    torch.testing.assert_close(whole(args["hidden"], args["topk_weights"], args["topk_ids"]), expected)
    partial = torch.zeros(T, H)
    for rank in range(2):
        shard = _layer(rank, 2, args)
        assert shard.w13_weight.shape == (E, N, H) and shard.w2_weight.shape == (E, H, N // 2)
        # Rank r's gate rows and up rows are the r-th halves of each (gate block, then up block).
        half = N // 2
        assert torch.equal(shard.w13_weight[:, :half], args["w13"][:, rank * half : (rank + 1) * half])
        assert torch.equal(shard.w13_weight[:, half:], args["w13"][:, N + rank * half : N + (rank + 1) * half])
        # What forward computes before its all-reduce: w2's bias on rank 0 only.
        partial += fused_moe_reference(
            args["hidden"], shard.w13_weight, shard.w2_weight, args["topk_weights"], args["topk_ids"], "swigluoai",
            shard.w13_bias, shard.w2_bias if rank == 0 else None,
        )
    torch.testing.assert_close(partial, expected, rtol=1e-5, atol=1e-5)


def test_layer_loads_gate_and_up_halves_and_refuses_bad_shapes() -> None:
    from pagedllm.api.model import WeightLoadError

    args = _inputs(8)
    layer = FusedMoE(_ctx(0, 1), E, K, H, N, prefix="moe")
    layer.w13_weight.weight_loader(layer.w13_weight, args["w13"][:, :N], "gate")
    layer.w13_weight.weight_loader(layer.w13_weight, args["w13"][:, N:], "up")
    assert torch.equal(layer.w13_weight, args["w13"])
    with pytest.raises(WeightLoadError, match="intermediate axis"):
        layer.w2_weight.weight_loader(layer.w2_weight, torch.zeros(E, H, N + 2))
    with pytest.raises(WeightLoadError, match="shard id"):
        layer.w13_weight.weight_loader(layer.w13_weight, args["w13"][:, :N], "down")
    with pytest.raises(ValueError, match="top_k 7"):
        FusedMoE(_ctx(0, 1), E, 7, H, N)
    with pytest.raises(ValueError, match="not divisible"):
        FusedMoE(_ctx(0, 5), E, K, H, N)
