"""The collectives tensor-parallel layers call; each is the identity when the group has one rank.

Layers pass their own `tp_size` (fixed when the model was built), so a tp_size-1 model never touches
torch.distributed, even in a process that belongs to a group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place (identity at tp_size 1)."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (identity at tp_size 1)."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tp_min(value: int, tp_size: int) -> int:
    """The smallest `value` over the group, e.g. the KV blocks every rank can hold (identity at tp_size 1)."""
    if tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def tp_broadcast(x: torch.Tensor, tp_size: int, src: int = 0) -> torch.Tensor:
    """Every rank's `x` becomes rank `src`'s, in place (identity at tp_size 1). Same shape and dtype on every
    rank; on NCCL it is queued on the device like the other collectives (no host wait)."""
    if tp_size > 1:
        dist.broadcast(x, src)
    return x
