"""The quorum's collectives: FlexDeMo's exchange, and the parameter checksums nodes compare, on torchft's group.

torchft rebuilds its process group for every quorum that changes. A collective on it that fails
(a peer died or timed out mid-exchange) is reported to the manager, so the step will not commit
on this node, instead of raised: the node undoes the step and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from ..topology import ReplicaTopology
from .timeline import RoundClock


class QuorumGroup:
    """torchft's process group of the current quorum, whose failures the manager hears of."""

    def __init__(self, manager, group, device: torch.device, clock: RoundClock):
        self._manager, self._group, self.device, self._clock = manager, group, device, clock

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> _ReportedWork:
        if self._manager.errored():
            return _ReportedWork(None, self._manager)
        size = output.numel() // max(tensor.numel(), 1)
        parts = list(output.view(size, -1).unbind(0)) if tensor.numel() else [output] * size
        try:
            with self._clock.timing("exchange"):
                work = self._group.allgather([parts], [tensor.view(-1)], AllgatherOptions())
        except Exception as e:
            self._manager.report_error(e)
            return _ReportedWork(None, self._manager)
        return _ReportedWork(work, self._manager, self._clock)

    def all_reduce_sum(self, tensor: torch.Tensor) -> _ReportedWork:
        if self._manager.errored():
            return _ReportedWork(None, self._manager)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        try:
            with self._clock.timing("exchange"):
                work = self._group.allreduce([tensor], options)
        except Exception as e:
            self._manager.report_error(e)
            return _ReportedWork(None, self._manager)
        return _ReportedWork(work, self._manager, self._clock)

    def fingerprints_of_leaders(self, fingerprint: torch.Tensor, size: int, step: int) -> list[int]:
        """The checksums of the ``size`` nodes that committed the most steps (``step``: this node's count), or
        ``[]`` if the comparison failed."""
        mine = torch.tensor([step, int(fingerprint)], dtype=torch.int64, device=self.device)
        gathered = torch.zeros(2 * size, dtype=torch.int64, device=self.device)
        self.all_gather_into(gathered, mine).wait()
        if self._manager.errored():
            return []
        pairs = gathered.view(-1, 2).tolist()
        lead = max(node_steps for node_steps, _ in pairs)
        return [value for node_steps, value in pairs if node_steps == lead]

    def shutdown(self) -> None:
        self._group.shutdown()


class _ReportedWork:
    """A collective whose failure is reported to the manager (the step will not commit) instead of raised."""

    def __init__(self, work, manager, clock: RoundClock | None = None):
        self._work, self._manager, self._clock = work, manager, clock

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            with self._clock.timing("exchange"):
                self._work.wait()
        except Exception as e:  # a peer died or timed out mid-exchange
            self._manager.report_error(e)


@dataclass(frozen=True)
class ManagedTopology(ReplicaTopology):
    """The replicas of one step's quorum: collectives run on torchft's process group, errors are reported."""

    quorum: QuorumGroup | None = None

    @property
    def is_managed(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self.quorum.device

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        return self.quorum.all_gather_into(output, tensor)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        return self.quorum.all_reduce_sum(tensor)
