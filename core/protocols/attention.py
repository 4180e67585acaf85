"""Attention backend protocol: the KV layout, the per-step metadata and the kernel.

A backend is a class (registered by a plugin) with static capability methods; the model's attention layers
each hold one `AttentionImpl` made by `make_impl`. The model runner builds a `CommonAttentionMetadata` per
step and the backend turns it into whatever its kernel wants with `build_metadata` (once per step, shared by
all layers).

Hybrid models (several KV-cache groups, e.g. sliding-window and full-attention layers) get a
`KVGroupMetadata`: the backend's metadata built once per group, each from that group's block table and slot
mapping. A layer that reads a KV-cache group declares `kv_group_id` (the engine sets it) and picks its entry;
`pagedllm.layers.attention.Attention` does this, so models need no change.

CUDA graphs: `CUDAGraphAttentionBackend` lists the optional members a backend declares to have its decode steps
captured (worker/cuda_graphs.py), including the per-replay planning hook for kernels that read host-planned
state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch


@dataclass
class CommonAttentionMetadata:
    """Backend-neutral description of one step's batch. B = requests, T = scheduled tokens.

    Tokens of request i occupy rows query_start_loc[i] : query_start_loc[i+1] of q/k/v. Its context after
    this step is seq_lens[i] tokens, of which the last (query_start_loc[i+1] - query_start_loc[i]) are new;
    the new token at row t sits at position seq_lens[i] - query_len + (t - query_start_loc[i]) and is
    written to cache slot slot_mapping[t] = block_table[i][pos // block_size] * block_size + pos % block_size.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, on device
    seq_lens: torch.Tensor  # [B] int32, on device
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [T] int64, on device
    # Host copies, so backends can plan without a device->host sync.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Requests are ordered decodes first (query_len == 1), then prefills; this counts the leading decodes.
    num_decodes: int = 0
    # Decode-only steps on the GPU step buffers: int32 [P, s, flag per request] on the device -- the flagged
    # requests' first P tokens sit in the same KV blocks (request s's), P = 0 when nothing is worth a cascade.
    # The values change every step inside a captured graph; a backend may use them (cascade attention) or not.
    cascade: torch.Tensor | None = None


@dataclass(frozen=True)
class KVGroupMetadata:
    """One step's metadata per KV-cache group, indexed by group id (only models with several groups get it).

    Entries are whatever each group's builder returned: the attention backend's metadata for attention
    groups; another layer type (Mamba state) may put its own there. A one-group model gets the backend's
    metadata object directly, never this wrapper, so its per-step cost is unchanged.
    """

    groups: list[Any]

    def __getitem__(self, group_id: int) -> Any:
        return self.groups[group_id]

    def __len__(self) -> int:
        return len(self.groups)


@dataclass(frozen=True)
class AttentionLayerConfig:
    """What a model tells the backend about one attention layer."""

    num_heads: int
    head_size: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    # The engine's CPU fused C kernels for this model (KernelOptions.cpu_ops), for an impl that runs their
    # decode attention (CpuDecodeAttentionImpl); None for every other model.
    cpu_ops: Any = None
    # Learned per-head attention sinks (gpt-oss): [num_heads] logits, one per query head of this rank, that
    # join each softmax's denominator as exp(sink) and carry no value -- softmax over [scores | sink], the
    # sink's column dropped. The model's parameter itself (filled when weights load), so the impl keeps the
    # reference. Only backends that declare `supports_sinks = True` take it (the Attention layer checks).
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # Chunked local attention (Llama 4): positions split into chunks of this many tokens and a query at position
    # q sees only keys p with p // C == q // C (and p <= q); None for every other layer. The KV manager of its
    # ChunkedLocalAttentionSpec group releases earlier chunks' blocks, so reading them would read freed
    # memory: only backends that declare `supports_chunked_local = True` take it (the Attention layer checks).
    attention_chunk_size: int | None = None


class AttentionImpl(Protocol):
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # the backend's layout, from kv_cache_shape
        metadata: Any,  # what build_metadata returned
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        """Write key/value at metadata's slots, then attend causally over each request's whole context."""
        ...


class CpuDecodeAttentionImpl(Protocol):
    """Optional members of an impl whose one-token CPU decode runs the engine's C decode attention
    (KernelOptions.cpu_ops: the kernels a quantization method brings for its float32 CPU models).

    A model may then run a decode step as a flat list of C calls (the llama plugin's CPU decode plan) and ask
    the impl only these questions, never its internals; an impl without them is simply never taken that way.
    """

    def c_decode_params(self, ops: Any) -> tuple[float, int, float] | None:
        """(scale, sliding window or 0, soft cap or 0) when this layer's decode runs `ops`' C kernel, else None."""
        ...

    def c_decode_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> CommonAttentionMetadata | None:
        """The step's common metadata when this step's attention is the C decode kernel, None otherwise."""
        ...


class AttentionBackend(Protocol):
    """A backend class. Optional: `configure(options) -> AttentionBackend`, a classmethod the engine calls once
    at build with the backend's validated `plugins.<name>` section, returning the backend bound to it (e.g. a
    subclass holding the options), so two engines in one process may run different options; and
    `supports_sinks: ClassVar[bool]` (absent: False), whether its impls apply `AttentionLayerConfig.sinks`.
    A backend that does not also refuses `AttentionSelectionContext.sinks` in its check(), so the selector
    passes it over for a model with sinks. Likewise `supports_chunked_local: ClassVar[bool]` (absent: False)
    for `AttentionLayerConfig.attention_chunk_size`, refused through `AttentionSelectionContext.chunked_local`."""

    name: ClassVar[str]

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (K and V together)."""
        ...

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> Any:
        """Turn the step's common metadata into this backend's own (called once per step)."""
        ...

    @staticmethod
    def make_impl(layer: AttentionLayerConfig) -> AttentionImpl:
        """Make the per-layer kernel object."""
        ...


class CUDAGraphAttentionBackend(Protocol):
    """Optional members of a backend whose decode steps replay inside the runner's CUDA graphs.

    `supports_cuda_graphs = True` alone suits a backend whose metadata holds only device tensors derived on the
    device from the step buffers (triton): the captured kernels read the buffers, so a replay needs nothing.

    A backend whose kernels read *host-planned* state (FlashInfer's work schedule, page-table CSR) adds the pair
    below. The runner then builds each graph's metadata with `build_graph_metadata` (instead of
    `build_metadata`) on the padded dummy step, keeps that object for the graph's life, and calls
    `prepare_graph_replay(metadata, common)` before every replay with the step's padded common metadata
    (`common.num_reqs` is the graph's size; padding requests are 1-token decodes of the null block). The hook
    does host work and enqueues copies into the fixed buffers the captured kernels read -- no device->host
    sync. With several KV-cache groups both are called once per group, with that group's metadata.

    `cuda_graph_max_query_len` bounds the uniform multi-token steps (speculative verification) that get graphs;
    absent, every length the runner asks for is captured; 1 means decode graphs only.
    """

    supports_cuda_graphs: ClassVar[bool]
    cuda_graph_max_query_len: ClassVar[int]

    @staticmethod
    def build_graph_metadata(common: CommonAttentionMetadata) -> Any:
        """At capture: the metadata a graph of `common.num_reqs` requests is captured with (and kept)."""
        ...

    @staticmethod
    def prepare_graph_replay(metadata: Any, common: CommonAttentionMetadata) -> None:
        """Before each replay: re-plan `metadata` (what build_graph_metadata returned) for this step."""
        ...
