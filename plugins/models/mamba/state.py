"""What a Mamba layer needs to know about one step: which rows are decodes, each request's state slot, and
whether its state is fresh -- all read from the attention metadata the model runner already builds.

    request i, rows qsl[i] : qsl[i+1] (query_len = qsl[i+1] - qsl[i]), context seq_lens[i] after the step
    state slot        = block_table[i][0]          the Mamba manager's one real block (mamba/manager.py)
    has initial state = seq_lens[i] - query_len > 0 some tokens were computed before this step, so the
                                                    slot holds their state; else start from zeros
    decodes           = the leading num_decodes requests (one row each); prefills (and prefill chunks) after

Mamba groups never get prefix-cache hits, so "computed before this step" always means "computed by this
request into its slot" (after preemption a request restarts from zero computed tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.api import MambaSpec
from pagedllm.api.attention import CommonAttentionMetadata, KVGroupMetadata


@dataclass
class MambaStepInfo:
    """One step's batch layout for Mamba layers; built once per step and shared by every Mamba layer."""

    num_decodes: int
    num_tokens: int  # rows that hold real tokens (num_actual_tokens)
    decode_slots: torch.Tensor  # [num_decodes] int64, device
    decode_has_state: torch.Tensor  # [num_decodes] bool, device
    prefill_query_start_loc: list[int]  # [P + 1] host row offsets of the prefills, relative to the first
    prefill_slots: torch.Tensor  # [P] int64, device
    prefill_has_state: list[bool]  # [P] host
    # The same two on the device, for kernels that loop over requests on the GPU.
    prefill_query_start_loc_dev: torch.Tensor  # [P + 1] int32
    prefill_has_state_dev: torch.Tensor  # [P] bool

    @classmethod
    def from_metadata(cls, attn_metadata: Any, kv_group_id: int = 0) -> MambaStepInfo:
        """The layout for a Mamba group, from whatever metadata the runner passed the model."""
        return cls.from_common(common_metadata_of(attn_metadata, kv_group_id))

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> MambaStepInfo:
        """Derive the layout from the step's common metadata: device ops and host copies only, no sync."""
        nd, nr = common.num_decodes, common.num_reqs
        slots = common.block_table[:nr, 0].long()
        seq_lens = common.seq_lens[:nr]
        qsl_host = common.query_start_loc_cpu[: nr + 1].tolist()
        seq_host = common.seq_lens_cpu[:nr].tolist()
        first_prefill_row = qsl_host[nd]
        qsl_dev = common.query_start_loc[nd : nr + 1]
        query_lens_dev = qsl_dev[1:] - qsl_dev[:-1]
        return cls(
            num_decodes=nd,
            num_tokens=common.num_actual_tokens,
            decode_slots=slots[:nd],
            decode_has_state=seq_lens[:nd] > 1,
            prefill_query_start_loc=[q - first_prefill_row for q in qsl_host[nd:]],
            prefill_slots=slots[nd:],
            prefill_has_state=[
                seq_host[i] - (qsl_host[i + 1] - qsl_host[i]) > 0 for i in range(nd, nr)
            ],
            prefill_query_start_loc_dev=qsl_dev - first_prefill_row,
            prefill_has_state_dev=seq_lens[nd:] - query_lens_dev > 0,
        )


def common_metadata_of(attn_metadata: Any, kv_group_id: int) -> CommonAttentionMetadata:
    """The common metadata of this layer's KV-cache group, from whatever the runner passed to the model."""
    if isinstance(attn_metadata, KVGroupMetadata):
        attn_metadata = attn_metadata[kv_group_id]
    if isinstance(attn_metadata, CommonAttentionMetadata):
        return attn_metadata
    common = getattr(attn_metadata, "common", None)
    if not isinstance(common, CommonAttentionMetadata):
        raise TypeError(
            f"Mamba layers read the step layout from the attention metadata's `common` field; "
            f"{type(attn_metadata).__name__} has none"
        )
    return common


def state_views(cache: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer's cache [num_blocks, conv + ssm elements] into its conv and SSM state slot tensors.

    Both are views (the layer's in-place state writes land in the cache): [num_blocks, *conv_state_shape]
    and [num_blocks, *ssm_state_shape].
    """
    num_blocks = cache.shape[0]
    conv = cache[:, : spec.conv_state_numel].view(num_blocks, *spec.conv_state_shape)
    ssm = cache[:, spec.conv_state_numel :].view(num_blocks, *spec.ssm_state_shape)
    return conv, ssm
