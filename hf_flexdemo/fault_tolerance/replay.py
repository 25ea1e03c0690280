"""Catch-up by replay: the last committed steps' exchanged payloads, kept to bring a lagging node up to date.

A node that missed a few commits (it was slow, paused, or its link dipped) holds the job's
parameters as they were at its last commit. The steps it missed changed the parameters only
through their decoded updates, which every node computes from the same gathered payloads
(and the rules' shared state, such as adam's second moment, from those updates alone). So
instead of the whole state, a peer can send the payloads of those steps, and the lagging node
decodes and applies them in order: the same arithmetic on the same inputs, hence the same
bits as its peers. The payloads are compressed (DeMo: 75x to 350x fewer bytes than the
parameters), so a catch-up of a few steps moves a small fraction of a full copy.

Only schemes whose parameters move by the exchanged update alone can be replayed (not DiLoCo
or SparseLoCo, whose inner steps move each node's parameters by its own gradients).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from ..schemes.base import StepContext


@dataclasses.dataclass
class LoggedStep:
    """One committed step as every node applied it: per bucket, its hyperparameters and what ``apply`` got."""

    committed: int
    """The quorum's committed steps once this step committed (torchft's step count)."""
    ctx: StepContext | None
    """None: a round that exchanged nothing (the parameters did not move)."""
    groups: list[dict[str, Any]]
    """Per bucket: the step's hyperparameters (lr, weight decay, ...), without the parameters."""
    carried: list[Any]
    """Per bucket: what the scheme's ``local_step`` handed to ``apply`` (None: nothing was exchanged)."""
    parts: list[Any]
    """Per bucket: the exchanged payloads ``apply`` decoded (every replica's, in replica order)."""
    trained: bool = True
    """A training step (its step count and weight decay are replayed too), not a ``synchronize()`` round."""

    @property
    def nbytes(self) -> int:
        return _nbytes(self.parts) + _nbytes(self.carried)


def map_tensors(value: Any, fn) -> Any:
    """``value`` (tensors in nested lists and tuples) with ``fn`` applied to every tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(item, fn) for item in value)
    return value


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


class ReplayLog:
    """The last ``capacity`` committed steps, oldest first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._steps: deque[LoggedStep] = deque(maxlen=capacity or None)

    def record(self, step: LoggedStep) -> None:
        if not self.capacity:
            return
        if self._steps and step.committed != self._steps[-1].committed + 1:
            self._steps.clear()  # a gap (this node healed by a full copy): older steps no longer lead here
        self._steps.append(step)

    def since(self, committed: int, now: int) -> list[LoggedStep] | None:
        """The steps that take a node from ``committed`` to ``now`` committed steps, or None if any is not held."""
        wanted = [step for step in self._steps if committed < step.committed <= now]
        if len(wanted) != now - committed or not wanted or wanted[0].committed != committed + 1:
            return None
        return wanted

    def __len__(self) -> int:
        return len(self._steps)
