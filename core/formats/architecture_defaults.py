"""What transformers' config classes add to a config.json: class defaults and derived fields, per model type.

A hub config.json lists only what differs from its class's defaults (transformers 4.x wrote it so) and uses
older spellings (`rope_theta` / `rope_scaling` beside the fields, `torch_dtype`); transformers' config
classes fill the gaps on load. `complete_config` does the same for the model types the in-tree model plugins
serve, for the fields the engine reads (model_config.py NOTE 1 says how that stays true).

NOTE 1 (the values): the defaults are transformers 5.x's dataclass defaults for these classes
(LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Gemma2Config, Gemma3TextConfig, GptOssConfig,
MambaConfig, Mamba2Config, BambaConfig), the derivations their `__post_init__` and the RoPE mixin's
`convert_rope_params_to_dict` / `standardize_rope_params`. A field the class does not declare stays absent,
as it is on a transformers config.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

_INF = float("inf")
# Every transformers config's (PreTrainedConfig's own fields).
_BASE: dict[str, Any] = {"architectures": None, "dtype": None, "is_encoder_decoder": False}
_ATTENTION: dict[str, Any] = {**_BASE, "rope_parameters": None, "pad_token_id": None}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_ATTENTION, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
              "head_dim": None},
    "mistral": {**_ATTENTION, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {**_ATTENTION, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
              "bos_token_id": None, "eos_token_id": None},
    "qwen3": {**_ATTENTION, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28, "layer_types": None, "bos_token_id": None,
              "eos_token_id": None},
    "gemma2": {**_ATTENTION, "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
               "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
               "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "use_bidirectional_attention": None},
    "gemma3_text": {**_ATTENTION, "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
                    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    "gpt_oss": {**_ATTENTION, "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
                "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
                "num_key_value_heads": 8, "sliding_window": 128, "tie_word_embeddings": False,
                "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "layer_types": None,
                "bos_token_id": None, "eos_token_id": None, "attention_bias": True},
    "mamba": {**_BASE, "vocab_size": 50280, "hidden_size": 768, "state_size": 16,
              "num_hidden_layers": 32, "layer_norm_epsilon": 1e-5, "pad_token_id": 0, "bos_token_id": 0,
              "eos_token_id": 0, "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
              "hidden_act": "silu", "residual_in_fp32": True, "time_step_rank": "auto",
              "tie_word_embeddings": True},
    "mamba2": {**_BASE, "num_heads": 128, "head_dim": 64, "vocab_size": 32768,
               "hidden_size": 4096, "state_size": 128, "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5,
               "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "expand": 2, "conv_kernel": 4,
               "n_groups": 8, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
               "residual_in_fp32": True, "time_step_rank": "auto", "time_step_limit": (0.0, _INF),
               "chunk_size": 256, "tie_word_embeddings": False},
    "bamba": {**_ATTENTION, "vocab_size": 128000, "tie_word_embeddings": False, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 262144, "attn_layer_indices": None,
              "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
              "mamba_proj_bias": False, "time_step_limit": (0.0, _INF), "attention_bias": False,
              "mlp_bias": False},
}
KNOWN_MODEL_TYPES = frozenset(_DEFAULTS)

# Older layer-type names, renamed on load (transformers' remap_legacy_layer_types).
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# RoPE types whose pretraining length lives in the RoPE dict.
_SCALED_ROPE = ("llama3", "yarn", "longrope")
_SPECIAL_FLOATS = {"Infinity": _INF, "-Infinity": -_INF, "NaN": float("nan")}


def complete_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields with the class defaults and derived fields of its `model_type` filled in."""
    model_type = raw["model_type"]
    values = copy.deepcopy(_DEFAULTS[model_type])
    given = _decode_special_floats(copy.deepcopy(raw))
    _check_types(given, values)
    values.update(given)
    torch_dtype = values.pop("torch_dtype", None)
    if values.get("dtype") is None:
        values["dtype"] = torch_dtype
    _DERIVE.get(model_type, _no_derivation)(values)
    if isinstance(values.get("layer_types"), list):
        values["layer_types"] = [_LEGACY_LAYER_TYPES.get(t, t) for t in values["layer_types"]]
    return values


def _check_types(given: dict[str, Any], defaults: dict[str, Any]) -> None:
    """A number or flag of the wrong JSON type fails here, named, rather than deep in the model build
    (transformers' strict dataclasses refuse these too). null is left to the class: many fields allow it."""
    for name, value in given.items():
        default = defaults.get(name)
        if value is None or default is None or default == "auto" or name.endswith("_token_id"):
            continue  # "auto" sizes take an int or "auto"; token ids an int or a list of them
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(default)) or (isinstance(default, tuple) and isinstance(value, list))
        if not ok:
            raise ValueError(f"field {name!r} is {value!r} ({type(value).__name__}); expected "
                             f"{type(default).__name__} like the default {default!r}")


def _decode_special_floats(obj: Any) -> Any:
    # transformers writes inf / nan (e.g. Mamba-2's time_step_limit) as {"__float__": "Infinity"}.
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[obj["__float__"]]
        return {k: _decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_special_floats(v) for v in obj]
    return obj


def _no_derivation(values: dict[str, Any]) -> None:
    pass


def _default_kv_heads(values: dict[str, Any]) -> None:
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]


def _default_head_dim(values: dict[str, Any]) -> None:
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]


def _alternating_layers(values: dict[str, Any]) -> None:
    # Gemma 2 and gpt-oss: even layers local (sliding), odd layers global.
    if values.get("layer_types") is None:
        values["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(values["num_hidden_layers"])
        ]


def _standardize_rope(values: dict[str, Any], default_theta: float, forced: dict[str, Any] | None = None) -> None:
    """RoPE settings into `rope_parameters` (one dict, or one per layer type), as the RoPE mixin does.

    `rope_scaling` (the older name) wins over `rope_parameters`; `rope_theta` / `partial_rotary_factor`
    beside the fields move into it; scaled RoPE types get the pretraining length.
    """
    extra: dict[str, Any] = {k: values.pop(k) for k in ("rope_theta", "partial_rotary_factor") if k in values}
    extra.update(forced or {})
    scaling = values.pop("rope_scaling", None)
    params = scaling or values.get("rope_parameters") or {}
    theta = extra.get("rope_theta", default_theta)
    partial = extra.get("partial_rotary_factor")
    nested = _nested_keys(values, params)
    for entry in [params[k] for k in nested] or [params]:
        if entry is None:
            continue
        entry.setdefault("rope_theta", theta)
        if partial is not None:
            entry.setdefault("partial_rotary_factor", partial)
    _standardize_entries(values, params, nested)


def _nested_keys(values: dict[str, Any], params: dict[str, Any]) -> list[str]:
    labels = values.get("layer_types") or ()
    return [key for key in params if key in labels]


def _standardize_entries(values: dict[str, Any], params: dict[str, Any], nested: list[str]) -> None:
    entries = [params[k] for k in nested if params[k] is not None] if nested else [params]
    for entry in entries:
        entry.setdefault("rope_type", entry.get("type", "default"))
        entry.setdefault("rope_theta", None)
        if entry["rope_type"] in _SCALED_ROPE:
            entry.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    values["rope_parameters"] = params
    values["rope_scaling"] = params  # transformers' alias of rope_parameters


def _llama(values: dict[str, Any]) -> None:
    _default_head_dim(values)
    _default_kv_heads(values)
    _standardize_rope(values, 10000.0)


def _qwen(values: dict[str, Any]) -> None:
    # Qwen2 / Qwen3: the window counts only with use_sliding_window, on the layers from max_window_layers up.
    values["sliding_window"] = values.get("sliding_window") if values.get("use_sliding_window") else None
    _default_kv_heads(values)
    if values.get("layer_types") is None:
        window, first = values["sliding_window"], values["max_window_layers"]
        values["layer_types"] = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(values["num_hidden_layers"])
        ]
    _standardize_rope(values, 10000.0)


def _gemma2(values: dict[str, Any]) -> None:
    _alternating_layers(values)
    _standardize_rope(values, 10000.0)


def _gemma3_text(values: dict[str, Any]) -> None:
    if values.get("use_bidirectional_attention"):
        values["sliding_window"] = values["sliding_window"] // 2 + 1
    if values.get("layer_types") is None:
        pattern = values.get("sliding_window_pattern", 6)  # older configs: every n-th layer is global
        values["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(values["num_hidden_layers"])
        ]
    # Local and global layers each have their own RoPE: `rope_theta` is the global base,
    # `rope_local_base_freq` the local one; an older `rope_scaling` applies to the global layers.
    scaling = values.pop("rope_scaling", None)
    params = values.get("rope_parameters")
    if params is None:
        params = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
    if scaling is not None:
        params["full_attention"].update(scaling)
    if params.get("full_attention") is None:
        params["full_attention"] = {"rope_type": "default"}
    params["full_attention"].setdefault("rope_theta", values.pop("rope_theta", 1000000.0))
    if params.get("sliding_attention") is None:
        params["sliding_attention"] = {"rope_type": "default"}
    params["sliding_attention"].setdefault("rope_theta", values.pop("rope_local_base_freq", 10000.0))
    values.pop("rope_theta", None)
    values.pop("rope_local_base_freq", None)
    _standardize_entries(values, params, _nested_keys(values, params))


def _gpt_oss(values: dict[str, Any]) -> None:
    _default_kv_heads(values)
    _default_head_dim(values)
    _alternating_layers(values)
    if values.get("rope_parameters") is None:
        values["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096}
    _standardize_rope(values, 150000.0)


def _time_step_rank(values: dict[str, Any]) -> None:
    if values.get("time_step_rank") == "auto":
        values["time_step_rank"] = math.ceil(values["hidden_size"] / 16)


def _mamba(values: dict[str, Any]) -> None:
    values["intermediate_size"] = int(values["expand"] * values["hidden_size"])
    _time_step_rank(values)
    values["layer_types"] = ["linear_attention"] * values["num_hidden_layers"]


def _mamba2(values: dict[str, Any]) -> None:
    _time_step_rank(values)
    values["layer_types"] = ["linear_attention"] * values["num_hidden_layers"]


def _bamba(values: dict[str, Any]) -> None:
    _default_kv_heads(values)
    if values.get("mamba_d_head") == "auto":
        values["mamba_d_head"] = values["mamba_expand"] * values["hidden_size"] // values["mamba_n_heads"]
    if values.get("time_step_limit") is not None:
        values["time_step_limit"] = tuple(values["time_step_limit"])
    attention = values.get("attn_layer_indices") or ()
    values["layers_block_type"] = [
        "full_attention" if i in attention else "linear_attention" for i in range(values["num_hidden_layers"])
    ]
    values["layer_types"] = values["layers_block_type"]  # transformers maps one name onto the other
    # Bamba's attention rotates half of each head, whatever the file says.
    values.pop("partial_rotary_factor", None)
    _standardize_rope(values, 10000.0, forced={"partial_rotary_factor": 0.5})


_DERIVE: dict[str, Callable[[dict[str, Any]], None]] = {
    "llama": _llama,
    "mistral": _llama,  # head_dim and kv heads as Llama; its window is a plain field
    "qwen2": _qwen,
    "qwen3": _qwen,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gpt_oss": _gpt_oss,
    "mamba": _mamba,
    "mamba2": _mamba2,
    "bamba": _bamba,
}
