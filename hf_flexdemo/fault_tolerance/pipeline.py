"""What the fault-tolerance parts use of the optimizer: its settings, its state, and the step's parts.

:class:`~.rounds.QuorumRounds` and :class:`~.replica_state.ReplicaState` read the optimizer through
this interface and nothing else (``tests/test_composition.py`` checks both that they keep to it and
that :class:`~hf_flexdemo.FlexDeMo` provides it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..buckets import Bucket
    from ..config import FlexDeMoConfig
    from ..schemes.base import ReplicationScheme, StepContext
    from ..state_store import StateView
    from ..updates.base import UpdateRule


class StepPipeline(Protocol):
    config: FlexDeMoConfig
    scheme: ReplicationScheme
    rules: dict[str, UpdateRule]
    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]

    def buckets(self) -> list[Bucket]:
        """The buckets of the parameters, built on first use."""

    def decode_and_apply(self, buckets: list[Bucket], parts: list[Any], ctx: StepContext, *, decay: bool) -> None:
        """Decode each bucket's exchanged ``parts`` and move its parameters by its rule (``decay``: with weight
        decay)."""

    def decay(self, buckets: list[Bucket]) -> None:
        """Weight decay alone, on the buckets' parameters."""

    def needs_sync(self) -> bool:
        """Whether ``synchronize()`` has anything to exchange now."""

    def describe_replica(self) -> dict[str, Any]:
        """Settings and shapes every replica must share."""

    def flush(self) -> bool:
        """Apply a pending ``overlap`` exchange."""

    def drop_pending(self) -> None:
        """Forget a pending ``overlap`` exchange: the state it refers to is being replaced."""

    def forget_step_count(self) -> None:
        """The step counts changed in the state: read them again."""

    def forget_buckets(self) -> None:
        """The state was replaced: build the buckets again at the next step."""

    def state_view(self, param: torch.Tensor) -> StateView:
        """``param``'s state entries, read and created in this optimizer's layout."""
