"""Can a model config be split over `tp_size` ranks? Checked before anything is built, with the reason."""

from __future__ import annotations

from typing import Any


def check_tensor_parallel(hf_config: Any, tp_size: int) -> None:
    """Raise ValueError naming `parallel.tensor_parallel_size` and the config field that does not split.

    Query heads and MLP columns split evenly; KV heads split evenly when there are at least tp_size of them,
    otherwise each is replicated on tp_size / num_kv_heads ranks (so tp_size must be a multiple). The
    vocabulary needs nothing: it is padded up to a multiple of tp_size.
    """
    if tp_size == 1:
        return
    key = "parallel.tensor_parallel_size"
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads % tp_size:
        raise ValueError(f"{key} {tp_size} does not divide num_attention_heads {heads}")
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise ValueError(f"{key} {tp_size} does not divide num_key_value_heads {kv_heads}")
    if kv_heads < tp_size and tp_size % kv_heads:
        raise ValueError(
            f"{key} {tp_size} is not a multiple of num_key_value_heads {kv_heads} (each KV head must be "
            f"replicated on the same number of ranks)"
        )
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate is not None and int(intermediate) % tp_size:
        raise ValueError(f"{key} {tp_size} does not divide intermediate_size {intermediate}")
