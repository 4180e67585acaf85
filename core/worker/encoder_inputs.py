"""One step's encoder inputs and cross-attention metadata for an encoder-decoder model (BART, Whisper).

A request runs its encoder once, in its first step (num_computed_tokens == 0, also after a preemption);
its cross-attention K/V then live in the blocks of the cross-attention KV-cache group
(kv_cache/spec.py CrossAttentionSpec), and every decoder token of every later step reads all of them.

The attention backends attend causally over a request's context, so the step's cross-attention is laid out
for them as a batch of pseudo-requests, which the backend writes and reads like any other (writes first,
for the whole batch, then reads: the same order every backend keeps for self-attention):

    rows:      | d0 d1 ... d(T-1)                  | e(r0) ...     | e(r1) ...     |
               |<- T decoder query rows ---------->|<- encoder rows of the requests starting now (E) ->|
    pseudo-    one per decoder row: query_len 1,    one per starting request r: query_len = seq_len = E_r,
    request    seq_len = E_i of its request i,      writing its encoder K/V at its cross blocks' slots
               reading request i's cross blocks     (its attention output is discarded)
    slots      0 (the null block: the layer passes  cross_table[r][p // bs] * bs + p % bs for p < E_r
               zero K/V, never read)

A query of length 1 at the end of a seq_len-long context sees every key: exactly cross-attention's
unmasked softmax over the encoder output. The layer (the model plugin) concatenates [decoder queries | zero
rows] and [zero rows | encoder K/V] in this order and keeps the first T output rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.kv_cache.spec import CrossAttentionSpec
from pagedllm.protocols.attention import CommonAttentionMetadata, KVGroupMetadata


@dataclass
class EncoderInputs:
    """The encoder's share of one step: the prompts of the requests that start now, concatenated.

    Passed to an encoder-decoder model's forward as `encoder_inputs=`; E may be 0 (no request starts).
    """

    input_ids: torch.Tensor  # [E] int64, on the device
    positions: torch.Tensor  # [E] int64: 0 .. E_r - 1 within each prompt
    query_start_loc_cpu: torch.Tensor  # [R + 1] int32 on the host: prompt r is rows qsl[r] : qsl[r + 1]
    num_decoder_tokens: int  # T: the step's decoder rows, which come before the encoder rows (see top)

    @property
    def num_tokens(self) -> int:
        """E: encoder rows this step."""
        return int(self.input_ids.shape[0])


def plan_cross_attention(
    encoder_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    cross_block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> tuple[EncoderInputs, CommonAttentionMetadata]:
    """The step's encoder inputs and the cross-attention group's common metadata (the layout at the top).

    Per request (in the step's order): its encoder prompt ids, its computed and scheduled decoder tokens, its
    cross-attention block ids. A request with num_computed == 0 runs its encoder in this step.
    """
    num_reqs = len(num_scheduled)
    enc_lens = np.asarray([len(ids) for ids in encoder_ids], dtype=np.int64)
    capacity = np.asarray([len(b) for b in cross_block_ids], dtype=np.int64) * block_size
    short = np.nonzero(enc_lens > capacity)[0]
    if short.size or (enc_lens == 0).any():
        i = int(short[0]) if short.size else int(np.nonzero(enc_lens == 0)[0][0])
        raise ValueError(
            f"request {i}: an encoder prompt of {int(enc_lens[i])} tokens in {len(cross_block_ids[i])} "
            "cross-attention blocks (every request of an encoder-decoder model needs a non-empty encoder "
            "prompt and its blocks)"
        )
    starting = [i for i in range(num_reqs) if num_computed[i] == 0]
    scheduled = np.asarray(num_scheduled, dtype=np.int64)
    req_of_row = np.repeat(np.arange(num_reqs), scheduled)
    num_decoder_rows = int(scheduled.sum())

    width = max(1, int(max((len(b) for b in cross_block_ids), default=1)))
    table = np.zeros((num_reqs, width), dtype=np.int32)
    for i, ids in enumerate(cross_block_ids):
        table[i, : len(ids)] = ids
    pseudo_of = np.concatenate([req_of_row, np.asarray(starting, dtype=np.int64)])  # request of each pseudo-request
    query_lens = np.concatenate([np.ones(num_decoder_rows, dtype=np.int64), enc_lens[starting]])
    seq_lens = enc_lens[pseudo_of]
    qsl = np.zeros(len(pseudo_of) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])

    enc_rows_of = np.repeat(np.asarray(starting, dtype=np.int64), enc_lens[starting])
    enc_positions = np.concatenate([np.arange(int(enc_lens[i])) for i in starting]) if starting else np.zeros(0, np.int64)
    enc_slots = table[enc_rows_of, enc_positions // block_size].astype(np.int64) * block_size + enc_positions % block_size
    slot_mapping = np.concatenate([np.zeros(num_decoder_rows, dtype=np.int64), enc_slots])
    flat_ids = [t for i in starting for t in encoder_ids[i]]
    enc_qsl = np.zeros(len(starting) + 1, dtype=np.int64)
    np.cumsum(enc_lens[starting], out=enc_qsl[1:])

    num_decodes = int(np.argmin(query_lens == 1)) if (query_lens != 1).any() else len(query_lens)
    qsl_cpu = torch.from_numpy(qsl.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    common = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=torch.from_numpy(table[pseudo_of]).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        num_reqs=len(pseudo_of),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        block_size=block_size,
        num_decodes=num_decodes,
    )
    encoder = EncoderInputs(
        input_ids=torch.tensor(flat_ids, dtype=torch.int64).to(device),
        positions=torch.from_numpy(enc_positions.astype(np.int64)).to(device),
        query_start_loc_cpu=torch.from_numpy(enc_qsl.astype(np.int32)),
        num_decoder_tokens=num_decoder_rows,
    )
    return encoder, common


# An encoder-decoder step's encoder inputs and each cross-attention group's common metadata, by group id.
CrossLayout = tuple[EncoderInputs, dict[int, CommonAttentionMetadata]]


def plan_cross_layout(
    encoder_ids: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    group_block_ids: dict[int, list[list[int]]],
    block_sizes: Sequence[int],
    device: torch.device,
) -> CrossLayout:
    """`plan_cross_attention` for every cross-attention group (its block ids per request, by group id)."""
    planned = {
        g: plan_cross_attention(encoder_ids, num_computed, num_scheduled, ids, block_sizes[g], device)
        for g, ids in group_block_ids.items()
    }
    encoder = next(iter(planned.values()))[0]  # the same rows for every group
    return encoder, {g: common for g, (_, common) in planned.items()}


def cross_attention_groups(model: Any) -> list[int]:
    """The KV-cache groups of an encoder-decoder model's cross-attention layers (none for other models).

    The layers that declare `kv_group_id` come in kv_cache_specs() order (kv_cache/layout.py
    bind_kv_groups), so the group of each CrossAttentionSpec is read off its layer.
    """
    if getattr(model, "is_encoder_decoder", False) is not True:  # (`is True`: a test double's attributes are truthy)
        return []
    layers = [m for m in model.modules() if hasattr(m, "kv_group_id")]
    specs = model.kv_cache_specs()
    if len(layers) != len(specs):
        raise ValueError(f"{type(model).__name__}: {len(specs)} KV-cache specs but {len(layers)} KV layers")
    groups = sorted({layer.kv_group_id for layer, spec in zip(layers, specs, strict=True)
                     if isinstance(spec, CrossAttentionSpec)})
    if not groups or 0 in groups:
        raise ValueError(f"{type(model).__name__}: an encoder-decoder model needs its decoder self-attention in "
                         f"KV-cache group 0 and its cross-attention in groups of their own (got {groups})")
    return groups


def with_cross_metadata(backend: Any, metadata: Any, cross: dict[int, CommonAttentionMetadata]) -> KVGroupMetadata:
    """The step's per-group metadata with each cross-attention group's pseudo-batch (the top) put in at its
    group id; `metadata` holds the other groups' in order (one object when only group 0 is left)."""
    others = list(metadata.groups) if isinstance(metadata, KVGroupMetadata) else [metadata]
    groups: list[Any] = []
    for gid in range(len(others) + len(cross)):
        groups.append(backend.build_metadata(cross[gid]) if gid in cross else others.pop(0))
    return KVGroupMetadata(groups)
