"""The contract between the optimizer and a replication scheme.

A step runs in three phases, so that every parameter's payload travels in one collective.
Each phase takes a :class:`~hf_flexdemo.buckets.Bucket`: the parameters of one group that
share a local shape, handled as one ``(count, *shape)`` stack.

1. ``local_step(bucket, ctx)`` for every bucket: local maths; returns the tensors the bucket
   sends (or ``[]``); outer-step schemes first take the replica's own step (``inner_step``);
2. the optimizer packs all payloads into one collective of the scheme's ``collective`` kind;
3. ``apply(bucket, received, ctx)`` for every bucket: decode what arrived into one update
   (:class:`Decoded`), which the parameter group's update rule (:mod:`hf_flexdemo.updates`)
   turns into a step; the outer-step schemes move the parameters themselves.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ..buckets import Bucket, ParamSlot
from ..compression import ChunkPlan
from ..config import FlexDeMoConfig
from ..kernels import dense_decoder
from ..scheme_traits import SchemeTraits, register
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
    noise: torch.Generator | None = None
    """This replica's own draws (stochastic rounding)."""


@dataclass
class SparseCoefficients:
    """Every replica's top-k DCT coefficients of one bucket, as received: a decoded update not yet made dense."""

    plan: ChunkPlan
    parts: list[tuple[torch.Tensor, torch.Tensor]]
    """Per replica, in replica order: ``(indices, values)``, each ``(n_tiles, k)``."""
    mode: str
    """How the parts are averaged: ``selected`` (over the replicas that sent each coefficient) or ``mean``."""
    dtype: torch.dtype
    """The momentum's dtype, which the dense update takes."""
    kernels: str = "torch"
    """The setting ``kernels``: which implementation makes the update dense."""

    def dense(self) -> torch.Tensor:
        """The decoded update, ``count * numel`` entries: the average's inverse DCT."""
        return dense_decoder(self.kernels)(self.parts, self.plan, mode=self.mode, dtype=self.dtype).view(-1)


@dataclass
class Decoded:
    """One bucket's decoded update after an exchange: identical on every replica (or, from an outer-step scheme's
    ``inner_step``, this replica's own update, which the orthogonal rule orthogonalizes whatever its scale)."""

    bucket: Bucket
    dense: torch.Tensor | None = None
    """The update if made (see :attr:`update`)."""
    where: torch.Tensor | None = None
    """Flat positions in the bucket that ``update`` holds (random, striding); None: all of them."""
    sparse: SparseCoefficients | None = None
    """``kernels='triton'`` (demo): the update as received, which the sign rule applies without making it dense."""
    decay: float = 1.0
    """Weight decay's factor ``1 - lr * weight_decay``, applied by the rule in its pass over the parameters (1: the
    parameters were decayed before the exchange, or the step is no training step)."""

    @property
    def update(self) -> torch.Tensor:
        """The decoded momentum part (``lr`` is already in it), ``count * numel`` entries in the bucket's order
        (the first parameter's, then the next); a temporary the rule may change in place. Made from
        :attr:`sparse` on first use if the scheme left it sparse."""
        if self.dense is None:
            self.dense = self.sparse.dense()
        return self.dense


class ReplicationScheme(ABC):
    """How replicas keep one model: what each sends, and how received data updates a parameter."""

    name: str
    collective: Collective
    traits: SchemeTraits
    """What it supports (which settings apply): every class that has a ``name`` declares its own."""
    shared_keys: tuple[str, ...] = ()
    """State entries equal on every replica: a node that heals copies them from a peer (besides ``step``)."""
    local_keys: tuple[str, ...] = ()
    """State entries ``local_step`` changes before the exchange (undone if the step is not committed)."""
    moves_parameters_locally = False
    """Whether ``local_step`` changes the parameters (undone too)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a scheme users name (a base class does not)
            assert "traits" in cls.__dict__, f"{cls.__name__} names scheme {cls.name!r} without its own traits"
            register(cls)

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

    def init_state(self, bucket: Bucket) -> None:
        """Create every state entry the scheme will ever use (when the bucket is built, before weight decay).

        Distributed checkpoints load into the state that one zero-gradient step creates, so
        an entry created later would be dropped silently on resume.
        """

    def check_state(self, slot: ParamSlot) -> None:
        """Check one parameter's existing state against this run's layout: when its bucket is built."""

    def healed(self, param: torch.Tensor, state: StateView) -> None:
        """After this replica took a peer's parameters and shared state (fault tolerance)."""

    def inner_step(self, bucket: Bucket, ctx: StepContext) -> Decoded | None:
        """Outer-step schemes: the replica's own step on its own gradient, before ``local_step``. Returns what the
        group's update rule is to apply to this replica alone (None: done here, or nothing to do)."""
        return None

    @abstractmethod
    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        """Local maths before the exchange; returns what this bucket sends."""

    @abstractmethod
    def apply(self, bucket: Bucket, received: Any, ctx: StepContext) -> Decoded | None:
        """The decoded update for the update rule, or None (nothing sent, or the scheme moved the parameters)."""

    def wire_dtype(self, bucket: Bucket) -> torch.dtype:
        return self.config.wire_dtype or bucket.dtype
