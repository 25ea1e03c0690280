"""The contract between the optimizer and an update rule."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..buckets import Bucket, ParamSlot
from ..config import FlexDeMoConfig
from ..kernels import step_adder
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

    def subtract(self, decoded: Decoded, step: torch.Tensor, scale: float = 1.0) -> None:
        """``p = decay * p - lr * scale * step`` for the bucket's parameters (``decoded.decay``), ``step`` at
        ``decoded.where`` (every entry when None); with ``kernels='triton'``, one fused pass
        (:mod:`hf_flexdemo.kernels.rule_step`)."""
        bucket = decoded.bucket
        if decoded.where is not None:  # a scattered subset (random, striding): zeros elsewhere
            dense = torch.zeros(bucket.count * bucket.numel, dtype=bucket.dtype, device=bucket.device)
            step = dense.index_add_(0, decoded.where, step.to(bucket.dtype))
        step_adder(self.kernels_for(bucket))(bucket.params, step, -bucket.group["lr"] * scale, decoded.decay)

    def kernels_for(self, bucket: Bucket) -> str:
        """The setting ``kernels``, or ``'torch'`` where the kernels cannot reach the parameters (not contiguous)."""
        if self.config.kernels == "torch" or not all(p.is_contiguous() for p in bucket.params):
            return "torch"
        return self.config.kernels
