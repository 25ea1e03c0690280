"""The wire: every tensor a step sends goes out in one packed collective, and is counted.

Two exchanges cover every scheme:

- :func:`all_gather_packed`: each replica sends different tensors of the same shapes
  (DeMo's top-k indices and values). The tensors are laid end to end as bytes in one
  ``uint8`` buffer and gathered with a single all-gather.
- :func:`all_reduce_mean_packed`: replicas send values at the same positions (dense or
  shared-seed subsets). Tensors of one dtype are concatenated and reduced with a
  single ``all_reduce`` per dtype.

Counted bytes are what this process puts on the inter-node link for the collective's
usual algorithm: an all-gather of ``B`` bytes per replica sends and receives
``(R - 1) * B``; a ring all-reduce of ``B`` bytes sends and receives ``2 (R - 1) / R * B``.
For two replicas both are exactly ``B``.

Both return an :class:`Exchange`. With ``async_op=True`` the collective runs in the
background (the process group's own thread or stream) until ``wait()``: that is how
FlexDeMo's ``overlap`` option hides the exchange behind the next forward and backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .topology import ReplicaTopology


@dataclass
class CommStats:
    """Inter-node bytes of this process."""

    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    """What a dense ring all-reduce of the same gradients in bf16 would have sent (the HSDP baseline,
    :func:`hf_flexdemo.optim.counters.bf16_dense_bytes`)."""
    collectives: int = 0
    seconds: float = 0.0
    """Wall time this process spent in (or waiting for) the collectives: per step only."""

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def x_fewer_than_bf16_dense(self) -> float:
        """The bf16 dense all-reduce's bytes over the bytes sent (inf when nothing was sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")


class Exchange:
    """A started collective: :meth:`wait` returns what it received and the bytes it moved."""

    def __init__(self, works: list, finish: Callable[[], Any], stats: CommStats, started: float):
        # Synchronous collectives return None instead of a work handle: nothing to wait for.
        self._works = [work for work in works if work is not None]
        self._finish, self.stats, self._started = finish, stats, started

    @classmethod
    def done(cls, received: Any) -> Exchange:
        return cls([], lambda: received, CommStats(), time.perf_counter())

    def wait(self) -> tuple[Any, CommStats]:
        waited = time.perf_counter()
        for work in self._works:
            work.wait()
        # Synchronous collectives ran before the Exchange existed: count from their start.
        self.stats.seconds = time.perf_counter() - (waited if self._works else self._started)
        return self._finish(), self.stats


def all_gather_bytes(payload_bytes: int, replicas: int) -> int:
    return (replicas - 1) * payload_bytes


def ring_all_reduce_bytes(payload_bytes: int, replicas: int) -> int:
    return round(2 * (replicas - 1) * payload_bytes / replicas)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_packed(tensors: Sequence[torch.Tensor], topology: ReplicaTopology, async_op: bool = False) -> Exchange:
    """Gather ``tensors`` from every replica; ``wait()`` gives ``received[replica][i]``.

    Every replica must pass tensors of the same shapes and dtypes in the same order.
    """
    if not topology.is_replicated:
        return Exchange.done([list(tensors)])
    started = time.perf_counter()
    device = tensors[0].device if tensors else torch.device("cpu")
    # Widest dtypes first: every slice then starts at a multiple of its element size.
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    flat = [tensors[i].contiguous().view(-1).view(torch.uint8) for i in order]
    buffer = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    size = buffer.numel()
    gathered = torch.empty(topology.size * size, dtype=torch.uint8, device=device)
    work = topology.all_gather_into(gathered, buffer, async_op=async_op)

    def unpack() -> list[list[torch.Tensor]]:
        received = []
        for replica in range(topology.size):
            # A fresh copy starts aligned for every dtype; our own part is the send buffer.
            chunk = buffer if replica == topology.rank else gathered[replica * size : (replica + 1) * size].clone()
            out: list[torch.Tensor | None] = [None] * len(tensors)
            offset = 0
            for i in order:
                t, n = tensors[i], nbytes(tensors[i])
                out[i] = chunk[offset : offset + n].view(t.dtype).view(t.shape)
                offset += n
            received.append(out)
        return received

    moved = all_gather_bytes(size, topology.size)
    stats = CommStats(bytes_sent=moved, bytes_received=moved, collectives=1)
    return Exchange([work], unpack, stats, started)


def all_reduce_mean_packed(
    tensors: Sequence[torch.Tensor], topology: ReplicaTopology, async_op: bool = False
) -> Exchange:
    """Average ``tensors`` over the replicas with one all-reduce per dtype; ``wait()`` gives the means."""
    if not topology.is_replicated:
        return Exchange.done(list(tensors))
    started = time.perf_counter()
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    buffers, works, stats = [], [], CommStats()
    for members in by_dtype.values():
        buffer = torch.cat([tensors[i].reshape(-1) for i in members])
        works.append(topology.all_reduce_sum(buffer, async_op=async_op))
        buffers.append((buffer, members))
        moved = ring_all_reduce_bytes(nbytes(buffer), topology.size)
        stats += CommStats(bytes_sent=moved, bytes_received=moved, collectives=1)

    def split() -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for buffer, members in buffers:
            buffer.div_(topology.size)
            offset = 0
            for i in members:
                n = tensors[i].numel()
                out[i] = buffer[offset : offset + n].view(tensors[i].shape)
                offset += n
        return out

    return Exchange(works, split, stats, started)
