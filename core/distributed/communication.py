"""The collectives model-parallel layers call; each is the identity when its group has one rank.

Layers pass their own `tp_size` (fixed when the model was built), so a tp_size-1 model never touches
torch.distributed, even in a process that belongs to a group. Tensor-parallel collectives run in this
stage's group (parallel_state.py NOTE 4: the default group unless pipeline parallelism split the world);
`world_min` spans every rank; `pp_send` / `pp_recv` move a stage's output to the next stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import get_parallel_state


def _tp_group() -> dist.ProcessGroup | None:
    return get_parallel_state().tp_group  # type: ignore[no-any-return]


def tp_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place (identity at tp_size 1)."""
    if tp_size > 1:
        dist.all_reduce(x, group=_tp_group())
    return x


def tp_all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (identity at tp_size 1)."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group())
    return torch.cat(parts, dim=dim)


def _min_over(value: int, group: dist.ProcessGroup | None) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def tp_min(value: int, tp_size: int) -> int:
    """The smallest `value` over the tensor-parallel group (identity at tp_size 1)."""
    return value if tp_size == 1 else _min_over(value, _tp_group())


def world_min(value: int) -> int:
    """The smallest `value` over every rank of every stage, e.g. the KV blocks each rank can hold: the
    scheduler's block ids address every stage's cache (identity in a one-rank world)."""
    return value if get_parallel_state().world_size == 1 else _min_over(value, None)


def tp_broadcast(x: torch.Tensor, tp_size: int, src: int = 0) -> torch.Tensor:
    """Every rank's `x` becomes tensor-parallel rank `src`'s, in place (identity at tp_size 1). Same shape and
    dtype on every rank; on NCCL it is queued on the device like the other collectives (no host wait)."""
    if tp_size > 1:
        state = get_parallel_state()
        dist.broadcast(x, state.global_rank(state.pp_rank, src), group=state.tp_group)
    return x


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send this stage's output to the same tensor-parallel rank of the next stage, in order."""
    state = get_parallel_state()
    dst = state.global_rank(state.pp_rank + 1, state.tp_rank)
    for t in tensors:
        dist.send(t.contiguous(), dst)


def pp_recv(tensors: list[torch.Tensor]) -> None:
    """Fill `tensors` (shapes known from the step, the same on both sides) from the previous stage."""
    state = get_parallel_state()
    src = state.global_rank(state.pp_rank - 1, state.tp_rank)
    for t in tensors:
        dist.recv(t, src)


def world_all_equal(value: object) -> bool:
    """Whether every rank of every stage passed an equal (picklable) `value` (True in a one-rank world)."""
    if get_parallel_state().world_size == 1:
        return True
    values: list[object] = [None] * get_parallel_state().world_size
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)
