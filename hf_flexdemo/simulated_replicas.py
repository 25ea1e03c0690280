"""R replicas trained in one process exactly as R nodes would train them (``simulate_replicas=R``).

After every step of a per-step scheme, all replicas hold the same parameters; only their
momenta (and the rest of their per-replica state) and their micro-batches differ. So one
process can keep one model, R copies of the per-replica state, and R gradients per step:

- :class:`ReplicaGradients` collects each replica's gradient as the micro-batches arrive;
- each replica's payload is made by the scheme's own ``local_step`` on its own state;
- :class:`LocalCollective` stands in for the process group: every replica posts its part, and
  the wait hands each replica what the all-gather (or all-reduce) would have delivered, so the
  wire's own packing and unpacking (:mod:`hf_flexdemo.wire`) run unchanged;
- the decoded update, identical on every replica, moves the one model once.

The optimizer (:class:`hf_flexdemo.FlexDeMo`) drives these; nothing here knows a scheme.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .topology import ReplicaTopology


class LocalCollective:
    """The collectives of R simulated replicas in one process.

    Every replica posts its tensor in turn; the first ``wait()`` after all have posted
    delivers the result to every replica's output. A replica's k-th post meets the others'
    k-th posts, as the k-th collective call of R processes would.
    """

    def __init__(self, size: int):
        self.size = size
        self._gathers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(size)]
        self._reduces: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def all_gather_into(self, rank: int, output: torch.Tensor, tensor: torch.Tensor) -> _LocalWork:
        self._gathers[rank].append((output, tensor))
        return _LocalWork(self)

    def all_reduce_sum(self, rank: int, tensor: torch.Tensor) -> _LocalWork:
        self._reduces[rank].append(tensor)
        return _LocalWork(self)

    def deliver(self) -> None:
        """Complete every posted collective (a no-op when none is pending)."""
        for calls in zip(*self._gathers, strict=True):
            parts = [tensor for _, tensor in calls]
            for output, _ in calls:
                torch.cat(parts, out=output)
        for calls in zip(*self._reduces, strict=True):
            total = calls[0].clone()
            for tensor in calls[1:]:  # in replica order: a fixed order, as the ring of two sums
                total += tensor
            for tensor in calls:
                tensor.copy_(total)
        for posted in (*self._gathers, *self._reduces):
            posted.clear()


@dataclass
class _LocalWork:
    collective: LocalCollective

    def wait(self) -> bool:
        self.collective.deliver()
        return True


@dataclass(frozen=True)
class SimulatedTopology(ReplicaTopology):
    """One simulated replica's view of the replicate group: its collectives run on ``local``."""

    local: LocalCollective | None = field(default=None, compare=False)

    @classmethod
    def replicas(cls, size: int) -> list[SimulatedTopology]:
        """Every replica's topology, sharing one local collective."""
        local = LocalCollective(size)
        return [cls(group=None, size=size, rank=rank, local=local) for rank in range(size)]

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        return self.local.all_gather_into(self.rank, output, tensor)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        return self.local.all_reduce_sum(self.rank, tensor)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class ReplicaGradients:
    """The gradients of one step's simulated replicas, taken out of ``.grad`` as each replica's backward ends."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.banked: list[dict[torch.Tensor, torch.Tensor | None]] = []
        """The replicas' gradients taken so far this step, in replica order, by parameter (None: no gradient)."""

    def take(self, params: list[torch.Tensor]) -> None:
        """The gradients now in ``params``' ``.grad`` are the next replica's; ``.grad`` is left empty for the next."""
        if len(self.banked) == self.replicas:
            raise RuntimeError(
                f"FlexDeMo: simulate_replicas={self.replicas}, but next_replica() was called a "
                f"{self.replicas + 1}th time before optimizer.step(); call it once after each replica's backward "
                f"(at most {self.replicas} times a step)."
            )
        self.banked.append({p: p.grad for p in params})
        for p in params:
            p.grad = None

    def check(self, params: list[torch.Tensor]) -> None:
        """Before a step changes anything: refuse a step that does not hold every replica's gradient."""
        in_grad = any(p.grad is not None for p in params)
        given = len(self.banked) + in_grad
        if given == self.replicas:
            return
        if given == self.replicas - 1 and self.banked and not in_grad:  # next_replica() after every backward of R-1
            given = f"{given} (next_replica() was called {len(self.banked)} times and .grad is empty)"
        self.banked = []
        raise RuntimeError(
            f"FlexDeMo: simulate_replicas={self.replicas} takes {self.replicas} replicas' gradients a step, but this "
            f"step has {given}. Call optimizer.next_replica() after each replica's backward but the last (or after "
            f"every one); with the Trainer, set gradient_accumulation_steps to a multiple of {self.replicas}."
        )

    def for_step(self) -> list[dict[torch.Tensor, torch.Tensor | None] | None]:
        """Each replica's gradients for this step (None: read ``.grad``, the last replica's), and the bank emptied."""
        banked, self.banked = self.banked, []
        return banked if len(banked) == self.replicas else [*banked, None]

    def clear(self) -> None:
        self.banked = []


def check_simulation_layout(params: list[torch.Tensor], topology: ReplicaTopology, replicas: int) -> None:
    """Refuse a simulation inside a job of several processes: each simulated replica is this whole process."""
    if topology.is_replicated:
        raise ValueError(
            f"FlexDeMo: simulate_replicas={replicas} trains {replicas} replicas in this one process, but the job also "
            f"has a real replicate group of {topology.size} nodes. Use one or the other: drop simulate_replicas to "
            "train across the nodes, or launch a single process (python script.py, or accelerate launch "
            "--num_processes 1)."
        )
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 or any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            f"FlexDeMo: simulate_replicas={replicas} keeps the whole model in one process, but this job runs "
            f"{world} processes (FSDP shards). Launch a single process (python script.py, or accelerate launch "
            "--num_processes 1), or drop simulate_replicas."
        )
