"""The profiling step: the largest step run once, so the builder sizes the KV cache from what is left of the
GPU's memory (model_runner's docstring; its NOTE 4 for the compile-ahead pass before it)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pagedllm.kv_cache.spec import CrossAttentionSpec
from pagedllm.layers.compile_ahead import compile_first
from pagedllm.worker.encoder_inputs import (
    CrossLayout,
    cross_attention_groups,
    plan_cross_layout,
    with_cross_metadata,
)
from pagedllm.worker.input_prep import StepInputs, build_attn_metadata, prepare_inputs


@torch.inference_mode()
def profile_activation_bytes(
    model: Any,
    backend: Any,
    specs: list[Any],
    block_size: int,
    num_tokens: int,
    num_logit_rows: int,
    device: torch.device,
    group_block_sizes: list[int] | None = None,
    max_seq_len: int | None = None,
    compile_ahead: bool = True,
) -> int:
    """Peak bytes the largest step allocates beyond what is live now (CUDA only; 0 elsewhere).

    Runs one prefill of `num_tokens` tokens (the scheduler's token budget) through the model and the logits of
    `num_logit_rows` rows, against a throw-away KV cache just large enough for it, and reads the allocator's
    peak. The builder subtracts this (and everything already allocated) from the memory budget before
    sizing the real cache. A hybrid model passes each KV-cache group's block size in `group_block_sizes`
    (the first is block_size); every group gets its own block table over the same throw-away blocks. An
    encoder-decoder model's step also runs every sequence's encoder (profile_step_inputs).
    The tokens are cut into sequences of at most `max_seq_len` (the model's positions): a budget larger than
    the context (16,384 tokens for an 8,192-position model) must not index the rotary tables past their end.
    """
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    lens, tables = profile_batch(num_tokens, max_seq_len, [block_size, *(group_block_sizes or [])[1:]])
    # Each sequence may round up a partial block of its own; block 0 is the null block.
    num_blocks = -(-num_tokens // min(group_block_sizes or [block_size])) + len(lens) + 1
    caches = [
        torch.empty(s.own_cache_shape(num_blocks)  # a layer type with its own layout (Mamba state)
                    or backend.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_size),
                    dtype=s.dtype, device=device)
        for s in specs
    ]
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    inputs, cross = profile_step_inputs(model, specs, lens, tables, block_size, group_block_sizes, device)
    # model_runner NOTE 4: this step's Triton binaries built in parallel first (same tensors, same peak).
    if compile_ahead:
        compile_first(functools.partial(forward_profile_step, model, backend, inputs, caches, cross))
    hidden = forward_profile_step(model, backend, inputs, caches, cross)
    if isinstance(hidden, torch.Tensor):  # a pipeline stage before the last has no logits
        rows = min(num_logit_rows, num_tokens)
        model.compute_logits(hidden[-rows:]).float().softmax(-1)  # the sampler's float32 copy of the logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline - cache_bytes
    del caches, hidden, inputs
    torch.cuda.empty_cache()
    return int(peak)


def profile_step_inputs(
    model: Any,
    specs: list[Any],
    lens: list[int],
    tables: list[list[list[int]]],
    block_size: int,
    group_block_sizes: list[int] | None,
    device: torch.device,
) -> tuple[StepInputs, CrossLayout | None]:
    """The profiling step's inputs (prompts of `lens` tokens from position 0, one table per group), and for an
    encoder-decoder model its encoder rows and cross-attention layout: every sequence starts, so every
    encoder runs, over min(its length, the encoder's limit) tokens (worker/encoder_inputs.py)."""
    sizes = [block_size, *(group_block_sizes or [])[1:]]
    cross_groups = cross_attention_groups(model)
    more = [(tables[g], sizes[g]) for g in range(1, len(sizes)) if g not in cross_groups]
    inputs = prepare_inputs([[0] * n for n in lens], [0] * len(lens), lens, tables[0], block_size, device, 0, more)
    if not cross_groups:
        return inputs, None
    limit = min(s.max_encoder_len for s in specs if isinstance(s, CrossAttentionSpec))
    # A group's table holds cdiv(n, its block size) blocks per sequence: room for min(n, limit) encoder tokens.
    encoder_ids = [[0] * min(n, limit) for n in lens]
    layout = plan_cross_layout(encoder_ids, [0] * len(lens), lens, {g: tables[g] for g in cross_groups}, sizes,
                               device)
    return inputs, layout


def forward_profile_step(
    model: Any, backend: Any, inputs: StepInputs, caches: list[torch.Tensor], cross: CrossLayout | None = None
) -> Any:
    """One forward of the profiling step (its hidden states; a pipeline stage before the last: its output)."""
    metadata = build_attn_metadata(backend, inputs)
    if cross is not None:
        return model(inputs.input_ids, inputs.positions, with_cross_metadata(backend, metadata, cross[1]), caches,
                     encoder_inputs=cross[0])
    stage = getattr(model, "ctx", None)
    if stage is not None and getattr(stage, "pp_size", 1) > 1:
        # A pipeline stage profiles alone: a stage after the first starts from zeros of the received shape.
        intermediate = (None if stage.is_first_stage
                        else model.make_empty_intermediate_tensors(int(inputs.input_ids.shape[0])))
        return model(inputs.input_ids, inputs.positions, metadata, caches, intermediate_tensors=intermediate)
    return model(inputs.input_ids, inputs.positions, metadata, caches)


def profile_batch(
    num_tokens: int, max_seq_len: int | None, block_sizes: list[int]
) -> tuple[list[int], list[list[list[int]]]]:
    """The profiling step's shape: sequence lengths (each <= max_seq_len) summing to num_tokens, and per
    group (one per block size) a block table per sequence over disjoint block ranges from block 1 on."""
    seq = max(1, min(num_tokens, max_seq_len or num_tokens))
    lens = [seq] * (num_tokens // seq) + ([num_tokens % seq] if num_tokens % seq else [])
    tables = []
    for size in block_sizes:
        starts = np.cumsum([0] + [-(-n // size) for n in lens])
        tables.append([list(range(1 + int(a), 1 + int(b))) for a, b in zip(starts[:-1], starts[1:], strict=True)])
    return lens, tables
