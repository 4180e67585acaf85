"""Which KV-cache group each layer joins, and which cache tensor it writes (page sharing, as in vLLM V1).

Groups (`group_layers`). Layers with equal specs share one block table. A hybrid model is split further so
that every group of the same page layout holds the same number of layers:

    Gemma 2, 2k layers, local/global alternating:  (local x k) (global x k)                 2 groups of k
    Gemma 3, 6k layers, 5 local : 1 global:        (local x k) x 5, (global x k)            6 groups of k
    20 full + 30 sliding (no n:1 pattern):         (full x 20), (sliding x 20), (sliding x 10 + 10 pad)

The group size is the smallest layer count among the specs of one layout (the "1" of an n:1 pattern),
or the largest when the counts are within 25% of each other (fewer, slightly padded groups).

Page sharing (`KVCacheLayout`). The block pool hands each block to one group at a time, so layer j of every
group of one layout can use the same tensor: block b of tensor j holds layer j of whichever group owns b.

    tensors:  T0  T1 ... T(k-1)            (one per layer slot; num_blocks blocks each)
    group 0:  L0  L2 ... L(2k-2)           a block of group 0 is written in T0..T(k-1) by its k layers
    group 1:  L1  L3 ... L(2k-1)           the same blocks, when group 1 owns them, by its own k layers

so a block costs page_size x k bytes (k = layers per group), not page_size x all layers, and every group's
tokens draw on one pool. A group with fewer layers than the slots (the padding above) leaves the slots it
does not use empty in the blocks it owns: that memory is wasted, which the split keeps small. Specs of
different page layouts (say another head size) never share tensors: each layout has its own slots, and a
block then costs the sum over layouts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.kv_cache.kv_cache_manager import KVCacheGroup
from pagedllm.kv_cache.spec import AttentionSpec, KVCacheSpec


def page_layout(spec: KVCacheSpec) -> Hashable:
    """Specs with equal keys lay a block out identically, so their groups can share cache tensors."""
    if isinstance(spec, AttentionSpec):
        # Full and sliding-window layers differ only in which blocks they keep, not in a block's bytes.
        return ("attention", spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
    return spec  # other layer types share only with identical specs


def group_layers(specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """KV-cache groups for per-layer specs: by spec, then split to equal sizes within a layout (see top)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    by_layout: dict[Hashable, list[KVCacheSpec]] = {}
    for spec in by_spec:
        by_layout.setdefault(page_layout(spec), []).append(spec)

    groups: list[KVCacheGroup] = []
    for layout_specs in by_layout.values():
        counts = [len(by_spec[s]) for s in layout_specs]
        size = min(counts)
        if max(counts) < 1.25 * size:
            size = max(counts)
        for spec in layout_specs:
            layers = by_spec[spec]
            groups += [KVCacheGroup(spec, layers[i : i + size]) for i in range(0, len(layers), size)]
    return groups


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups, the tensor slot of every layer, and the spec each slot's tensor is allocated for."""

    groups: list[KVCacheGroup]
    layer_slots: list[int]  # layer i (in kv_cache_specs order) writes tensor slot layer_slots[i]
    slot_specs: list[KVCacheSpec]  # one per tensor

    @classmethod
    def plan(cls, specs: Sequence[KVCacheSpec], share_pages: bool = True) -> KVCacheLayout:
        """Group the layers and give each one a tensor slot; `share_pages=False` gives every layer its own."""
        groups = group_layers(specs)
        layer_slots = [-1] * len(specs)
        slot_specs: list[KVCacheSpec] = []
        if not share_pages:
            return cls(groups, list(range(len(specs))), list(specs))
        first_slot: dict[Hashable, int] = {}  # layout -> its first slot
        for group in groups:
            layout = page_layout(group.spec)
            if layout not in first_slot:
                first_slot[layout] = len(slot_specs)
                width = max(len(g.layer_indices) for g in groups if page_layout(g.spec) == layout)
                slot_specs += [group.spec] * width
            for j, layer in enumerate(group.layer_indices):
                layer_slots[layer] = first_slot[layout] + j
        return cls(groups, layer_slots, slot_specs)

    @property
    def bytes_per_block(self) -> int:
        """What one block of the pool costs: one page in every tensor."""
        return sum(spec.page_size_bytes for spec in self.slot_specs)

    @property
    def group_ids(self) -> list[int]:
        """The KV-cache group of every layer, in kv_cache_specs order."""
        ids = [0] * len(self.layer_slots)
        for gid, group in enumerate(self.groups):
            for layer in group.layer_indices:
                ids[layer] = gid
        return ids

    def padding_slots(self) -> int:
        """Layer slots some group leaves empty in the blocks it owns, summed over groups."""
        per_layout: dict[Hashable, int] = {}
        for spec in self.slot_specs:
            key = page_layout(spec)
            per_layout[key] = per_layout.get(key, 0) + 1
        return sum(per_layout[page_layout(g.spec)] - len(g.layer_indices) for g in self.groups)

    def allocate(self, backend: Any, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """Zeroed cache tensors, one per slot, listed per layer (layers sharing a slot share the tensor)."""
        tensors = [_allocate(spec, backend, num_blocks, device) for spec in self.slot_specs]
        return [tensors[slot] for slot in self.layer_slots]


def _allocate(spec: KVCacheSpec, backend: Any, num_blocks: int, device: torch.device) -> torch.Tensor:
    # A spec may fix its own tensor shape (a Mamba state row per block); attention leaves it to the backend.
    shape = spec.own_cache_shape(num_blocks)
    if shape is None:
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"{type(spec).__name__} gives no own_cache_shape and is not an attention spec")
        shape = backend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return torch.zeros(shape, dtype=getattr(spec, "dtype", None), device=device)


def bind_kv_groups(model: Any, layout: KVCacheLayout) -> None:
    """Tell each KV-reading layer of the model its group (the `kv_group_id` it picks its metadata with).

    Layers are the modules that declare `kv_group_id` (pagedllm.layers.attention.Attention does), in module
    order, which must be kv_cache_specs() order. A one-group model needs nothing: the default is group 0.
    """
    if len(layout.groups) == 1:
        return
    layers = [m for m in model.modules() if hasattr(m, "kv_group_id")]
    ids = layout.group_ids
    if len(layers) != len(ids):
        raise ValueError(
            f"{type(model).__name__}: {len(ids)} KV-cache specs over {len(layout.groups)} groups, but "
            f"{len(layers)} modules declare kv_group_id; each layer that reads a cache must declare it, "
            "in kv_cache_specs() order"
        )
    for layer, gid in zip(layers, ids, strict=True):
        layer.kv_group_id = gid
