"""The contract between the optimizer and an update rule."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..buckets import Bucket, ParamSlot
from ..config import FlexDeMoConfig
from ..schemes.base import Decoded, StepContext


class UpdateRule(ABC):
    """Turns decoded updates into parameter steps: every bucket of one step at once, each as one stack."""

    name: str
    state_keys: tuple[str, ...] = ()
    """State entries the rule keeps, equal on every replica (checkpointed; copied by a healing node)."""

    def __init__(self, config: FlexDeMoConfig):
        self.config = config

    def init_state(self, bucket: Bucket) -> None:
        """Create the rule's state for ``bucket`` (when the bucket is built, before the exchange)."""

    def check_state(self, slot: ParamSlot) -> None:
        """Check ``slot`` against what the rule needs: at the first step and after a load, before anything moves."""

    @abstractmethod
    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        """Move each ``decoded[i].bucket``'s parameters by its update (``ctx``: the step that exchanged it)."""

    @staticmethod
    def subtract(decoded: Decoded, step: torch.Tensor) -> None:
        """``p -= lr * step`` for the bucket's parameters, at ``decoded.where`` (every entry when None)."""
        bucket = decoded.bucket
        bucket.add_to_params(step, -bucket.group["lr"], where=decoded.where)
