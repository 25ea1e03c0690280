"""Small helpers that treat a DTensor's local shard and a plain tensor alike."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place changes reach the DTensor), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
