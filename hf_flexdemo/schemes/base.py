"""The contract between the optimizer and a replication scheme.

A step runs in three phases, so that every parameter's payload travels in one collective:

1. ``local_step(slot, ctx)`` for every parameter: local maths; returns the tensors this
   parameter sends (or ``[]``);
2. the optimizer packs all payloads into one collective of the scheme's ``collective`` kind;
3. ``apply(slot, received, ctx)`` for every parameter: decode what arrived into one update
   (:class:`Decoded`), which the parameter group's update rule (:mod:`hf_flexdemo.updates`)
   turns into a step; the outer-step schemes move the parameter themselves.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..config import FlexDeMoConfig
from ..state_store import StateView


class Collective(enum.Enum):
    ALL_GATHER = "all_gather"
    """Replicas send different positions; ``apply`` receives every replica's tensors."""
    ALL_REDUCE = "all_reduce"
    """Replicas send the same positions; ``apply`` receives the mean over replicas."""
    NONE = "none"
    """Nothing crosses nodes; ``apply`` receives this replica's own tensors."""


@dataclass
class StepContext:
    """What every parameter of one optimizer step shares."""

    step: int
    """Optimizer steps taken, this one included (1 on the first step)."""
    replicate: bool
    """Whether this step exchanges anything across replicas."""
    replicas: int
    rank: int = 0
    """This replica's place among the ``replicas`` (0 to replicas - 1)."""
    generator: torch.Generator | None = None
    """Shared by every replica (the same draws everywhere: random's positions)."""
    noise: torch.Generator | None = None
    """This replica's own draws (stochastic rounding)."""


@dataclass
class ParamSlot:
    """One parameter during one step: its local shard, gradient, state and hyperparameters."""

    param: torch.Tensor
    grad: torch.Tensor
    state: StateView
    group: dict[str, Any]
    index: int
    """Position of the parameter in the optimizer (the same on every replica)."""
    carried: Any = None
    """What ``local_step`` hands to ``apply``, one value per scheme (None: nothing was sent):
    demo the ``ChunkPlan`` of the coefficients sent (with ``shared_indices``, and the index set);
    random/striding the flat positions sent; full and diloco ``True``."""


@dataclass
class Decoded:
    """One parameter's decoded update after an exchange: identical on every replica."""

    slot: ParamSlot
    update: torch.Tensor
    """The decoded momentum part (``lr`` is already in it); a temporary the rule may change in place."""
    where: torch.Tensor | None = None
    """Flat positions of the local parameter that ``update`` holds (random, striding); None: all of them."""


class ReplicationScheme(ABC):
    """How replicas keep one model: what each sends, and how received data updates a parameter."""

    name: str
    collective: Collective
    shared_keys: tuple[str, ...] = ()
    """State entries equal on every replica: a node that heals copies them from a peer (besides ``step``)."""
    local_keys: tuple[str, ...] = ()
    """State entries ``local_step`` changes before the exchange (undone if the step is not committed)."""
    moves_parameters_locally = False
    """Whether ``local_step`` changes the parameters (undone too)."""

    def __init__(self, config: FlexDeMoConfig):
        self.config = config

    def is_replication_step(self, step: int, forced: bool = False) -> bool:
        """Whether step ``step`` (1-based) exchanges data; ``forced`` asks for a sync now."""
        return forced or step % self.config.replicate_every == 0

    def replicas_match(self, state: StateView, step: int) -> bool:
        """Whether, by design, replicas hold identical parameters after step ``step``."""
        return True

    def needs_sync(self, state: StateView, step: int) -> bool:
        """Whether :meth:`FlexDeMo.synchronize` at step ``step`` has work to do."""
        return False

    def init_state(self, slot: ParamSlot) -> None:
        """Create every state entry the scheme will ever use (called each step, before weight decay).

        Distributed checkpoints load into the state that one zero-gradient step creates, so
        an entry created later would be dropped silently on resume. Runs every step: no host
        synchronisation here (checks that read state values belong in :meth:`check_state`).
        """

    def check_state(self, slot: ParamSlot) -> None:
        """Check existing state against this run's layout: at the first step and after a load only."""

    def healed(self, param: torch.Tensor, state: StateView) -> None:
        """After this replica took a peer's parameters and shared state (fault tolerance)."""

    @abstractmethod
    def local_step(self, slot: ParamSlot, ctx: StepContext) -> list[torch.Tensor]:
        """Local maths before the exchange; returns what this parameter sends."""

    @abstractmethod
    def apply(self, slot: ParamSlot, received: Any, ctx: StepContext) -> Decoded | None:
        """The decoded update for the update rule, or None (nothing sent, or the scheme moved the parameter)."""

    def wire_dtype(self, slot: ParamSlot) -> torch.dtype:
        return self.config.wire_dtype or slot.param.dtype
