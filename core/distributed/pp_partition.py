"""Which decoder layers each pipeline stage holds, checked before anything is built, with the reason.

Layers split into `pipeline_parallel_size` contiguous ranges, as vLLM's get_pp_indices does: an even split
when the stage count divides the layer count; otherwise each stage gets the floor and the remainder goes
one layer each to the stages just before the last (the last also runs the final norm, the LM head and the
sampler, the first the embedding, so the extra layers land on the stages with the least else to do).
`parallel.pp_layer_partition` (vLLM's VLLM_PP_LAYER_PARTITION; also PAGEDLLM_PARALLEL__PP_LAYER_PARTITION)
names the split explicitly: one layer count per stage.

    8 layers, 2 stages        [4, 4]      stage 0: layers 0-3, stage 1: 4-7
    7 layers, 3 stages        [2, 3, 2]   floor 2, remainder 1 -> the stage before the last
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_KEY = "parallel.pipeline_parallel_size"
_PARTITION_KEY = "parallel.pp_layer_partition"


def stage_layer_counts(num_layers: int, pp_size: int, partition: Sequence[int] | None = None) -> list[int]:
    """Layers per stage; raises ValueError naming the config key when the layers cannot be split so."""
    if partition is not None:
        if len(partition) != pp_size:
            raise ValueError(
                f"{_PARTITION_KEY} {list(partition)} has {len(partition)} entries; {_KEY} is {pp_size} "
                "(one layer count per stage)"
            )
        if any(n < 1 for n in partition) or sum(partition) != num_layers:
            raise ValueError(
                f"{_PARTITION_KEY} {list(partition)}: every stage needs at least one layer and the counts must "
                f"sum to the model's num_hidden_layers {num_layers}"
            )
        return list(partition)
    if pp_size > num_layers:
        raise ValueError(
            f"{_KEY} {pp_size} is more than the model's num_hidden_layers {num_layers}: every stage needs at "
            "least one decoder layer"
        )
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def get_pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` holds."""
    counts = stage_layer_counts(num_layers, pp_size, partition)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def describe_split(num_layers: int, pp_size: int, partition: Sequence[int] | None = None) -> str:
    """One line a log (and `config show --resolve`) can print: why each stage holds what it holds."""
    counts = stage_layer_counts(num_layers, pp_size, partition)
    why = ("as configured (parallel.pp_layer_partition)" if partition is not None else
           "even" if num_layers % pp_size == 0 else
           f"uneven: {num_layers} layers over {pp_size} stages, the remainder on the stages before the last")
    ranges, start = [], 0
    for stage, n in enumerate(counts):
        ranges.append(f"stage {stage}: " + (f"layer {start}" if n == 1 else f"layers {start}-{start + n - 1}"))
        start += n
    return f"pipeline split {counts} ({why}); " + ", ".join(ranges)


def check_pipeline_parallel(hf_config: Any, pp_size: int, partition: Sequence[int] | None = None) -> str | None:
    """Raise ValueError naming the key when the model cannot be split over `pp_size` stages; else the split's
    description (None at pp_size 1)."""
    if pp_size == 1:
        if partition is not None and list(partition) != [int(hf_config.num_hidden_layers)]:
            raise ValueError(f"{_PARTITION_KEY} {list(partition)} is set but {_KEY} is 1")
        return None
    return describe_split(int(hf_config.num_hidden_layers), pp_size, partition)
