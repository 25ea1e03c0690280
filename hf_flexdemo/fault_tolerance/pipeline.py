"""What the fault-tolerance parts use of the optimizer: its settings, its state, and the step's parts.

:class:`~.rounds.QuorumRounds` (the wrapper around the step) and :class:`~.replica_state.ReplicaState` read the
optimizer through this interface and nothing else (``tests/test_composition.py`` checks both that they keep to it
and that :class:`~hf_flexdemo.FlexDeMo` provides it). The step's parts are the optimizer's one path
(``begin``, ``encode``, ``send``); the wrapper runs them inside its rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..buckets import Bucket, BucketBook
    from ..config import FlexDeMoConfig
    from ..optim.apply_rules import RuleApplier
    from ..optim.in_flight import EncodedStep
    from ..schemes.base import ReplicationScheme
    from ..state_store import StateStore
    from ..topology import ReplicaTopology
    from ..updates.base import UpdateRule


class StepPipeline(Protocol):
    config: FlexDeMoConfig
    scheme: ReplicationScheme
    rules: dict[str, UpdateRule]
    applier: RuleApplier
    """Decodes exchanged parts and moves the parameters by their rules (a replayed step too)."""
    book: BucketBook
    """The buckets and the step count on the host: ``forget()`` and ``forget_step_count()`` make them read again."""
    store: StateStore | None
    topology: ReplicaTopology
    """The replicas this optimizer exchanges with (read first, it decides the state's layout)."""
    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]

    def attach(self, mesh: None) -> None:
        """Decide the state's layout as one replica's (the wrapper's node exchanges through its own group)."""

    def buckets(self) -> list[Bucket]:
        """The buckets of the parameters, built on first use."""

    def steps_taken(self) -> int:
        """Optimizer steps taken."""

    def begin(self, sync_only: bool, *, must_run: bool = False) -> list[Bucket] | None:
        """The buckets of a step that runs (a training step counts itself), or None."""

    def encode(
        self,
        buckets: list[Bucket],
        *,
        sync_only: bool,
        topology: ReplicaTopology,
        step: int | None = None,
        drop_gradient: bool = False,
        guard=None,
    ) -> EncodedStep:
        """The step's local part, with the guard that decides after the exchange."""

    def send(self, step: EncodedStep) -> bool:
        """Exchange and apply the step (through its guard)."""

    def needs_sync(self) -> bool:
        """Whether ``synchronize()`` has anything to exchange now."""

    def describe_replica(self) -> dict[str, Any]:
        """Settings and shapes every replica must share."""

    def flush(self) -> bool:
        """Apply a pending ``overlap`` exchange."""
