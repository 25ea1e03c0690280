"""The contract between the optimizer and an update rule."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..config import FlexDeMoConfig
from ..schemes.base import Decoded, ParamSlot, StepContext


class UpdateRule(ABC):
    """Turns decoded updates into parameter steps; every parameter of one step at once."""

    name: str
    state_keys: tuple[str, ...] = ()
    """State entries the rule keeps, equal on every replica (checkpointed; copied by a healing node)."""

    def __init__(self, config: FlexDeMoConfig):
        self.config = config

    def init_state(self, slot: ParamSlot) -> None:
        """Create the rule's state for ``slot`` (every step, before the exchange; no host syncs)."""

    def check_state(self, slot: ParamSlot) -> None:
        """Check ``slot`` against what the rule needs: at the first step and after a load, before anything moves."""

    @abstractmethod
    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        """Move each ``decoded[i].slot.param`` by its update (``ctx``: the step that exchanged it)."""

    @staticmethod
    def subtract(decoded: Decoded, step: torch.Tensor) -> None:
        """``p -= lr * step`` at ``decoded.where`` (every entry when None)."""
        slot = decoded.slot
        step = step.to(slot.param.dtype)
        if decoded.where is None:
            slot.param.sub_(step.view(slot.param.shape), alpha=slot.group["lr"])
        else:
            slot.param.view(-1).index_add_(0, decoded.where, step, alpha=-slot.group["lr"])
