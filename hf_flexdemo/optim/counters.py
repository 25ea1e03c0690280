"""Inter-node byte counters: what each process put on the link, and what a dense all-reduce would have.

Kept per parameter in the optimizer state (so a checkpoint restores them) and added on the
host between reads, so that counting costs no host synchronisation per step.

The baseline is the one a user would otherwise run: HSDP's ring all-reduce of bf16 gradients
(:func:`bf16_dense_bytes`, 2 bytes per parameter), whatever dtype this run's gradients have, so
that the logged ratio (:func:`x_fewer_than_bf16_dense`) and README's wire table agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..dtensor_utils import local_tensor
from ..schemes import Collective
from ..wire import CommStats, all_gather_bytes, nbytes, ring_all_reduce_bytes

if TYPE_CHECKING:
    from ..buckets import ParamSlot
    from .in_flight import InFlight

DENSE_BYTES_PER_PARAM = 2
"""The baseline's gradients are bf16, as a bf16 run's HSDP all-reduce sends them."""

COUNTERS = "comm_bytes"
"""Per-rank int64 pair kept in each parameter's state: bytes this process put on the inter-node
link, and what the dense bf16 ring all-reduce of its gradients would have put there."""


def bf16_dense_bytes(numel: int, replicas: int) -> int:
    """What one process puts on the inter-node link to all-reduce ``numel`` bf16 gradients among ``replicas``."""
    return ring_all_reduce_bytes(numel * DENSE_BYTES_PER_PARAM, replicas)


def x_fewer_than_bf16_dense(sent: float, dense: float) -> float:
    """How many times fewer bytes ``sent`` is than ``dense`` (:func:`bf16_dense_bytes`); 0 when nothing was sent."""
    return dense / sent if sent else 0.0


class ByteCounters:
    """The optimizer's inter-node byte counters, for a scheme whose exchange is ``collective``."""

    def __init__(self, collective: Collective):
        self.collective = collective
        self.last_step = CommStats()
        """The last exchange's bytes, as the wire counted them."""
        self._uncounted: dict[int, list[Any]] = {}  # per bucket: [slots, bytes sent, dense bytes] not yet in the state

    def count(self, job: InFlight, stats: CommStats) -> None:
        """Add the step's bytes on the host, per bucket; they reach the state tensors at the next read or save.

        Counted per step with that step's number of replicas (a quorum's size can change).
        """
        dense, replicas = 0, job.ctx.replicas
        for bucket, payload, seen in zip(job.buckets, job.payloads, job.grad_bytes):
            sent = self.wire_bytes(sum(nbytes(t) for t in payload), replicas) if job.ctx.replicate else 0
            pending = self._uncounted.setdefault(id(bucket.slots), [bucket.slots, 0, 0])
            pending[1] += sent
            numel = bucket.shape.numel() if seen else 0  # this process's shard of each parameter
            pending[2] += bf16_dense_bytes(numel, replicas) * bucket.count
            dense += numel * bucket.count
        stats.dense_bytes = bf16_dense_bytes(dense, replicas)
        self.last_step = stats

    def flush(self) -> None:
        """Each bucket's bytes into its parameters' counters: split evenly, the remainder to the first."""
        for slots, sent, seen in self._uncounted.values():
            _add_to_slots(slots, sent, seen)
        self._uncounted.clear()

    def forget(self) -> None:
        """Drop the bytes not yet in the state (it is being replaced by a loaded one)."""
        self._uncounted.clear()

    def total(self, param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict[str, Any]]) -> CommStats:
        """Cumulative inter-node bytes of this process: what the state holds (restored with it) and the rest."""
        self.flush()
        moved = dense = 0
        for group in param_groups:
            for p in group["params"]:
                if COUNTERS in state.get(p, {}):
                    sent_p, dense_p = (int(x) for x in local_tensor(state[p][COUNTERS]).reshape(2).tolist())
                    moved += sent_p
                    dense += dense_p
        return CommStats(bytes_sent=moved, bytes_received=moved, dense_bytes=dense)

    def wire_bytes(self, payload: int, replicas: int) -> int:
        """What one process puts on the link to exchange ``payload`` bytes among ``replicas``."""
        if replicas == 1 or self.collective is Collective.NONE:
            return 0
        if self.collective is Collective.ALL_GATHER:
            return all_gather_bytes(payload, replicas)
        return ring_all_reduce_bytes(payload, replicas)


def _add_to_slots(slots: list[ParamSlot], sent: int, seen: int) -> None:
    share, extra = divmod(sent, len(slots))
    for i, slot in enumerate(slots):
        counters = slot.state.counters(COUNTERS, 2)
        mine = [share + (extra if i == 0 else 0), seen // len(slots)]
        counters.add_(torch.tensor(mine, dtype=torch.int64).to(counters.device))
