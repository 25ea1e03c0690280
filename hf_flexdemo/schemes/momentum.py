"""What DeMo, Random, Striding, full sync and none share: a decoupled momentum with error feedback.

Every step, each replica folds its gradient into its own momentum::

    m = decay * m + lr * grad

On a replication step the scheme picks a part ``q`` of ``m`` (DeMo: the top-k DCT
coefficients; Random/Striding: a subset of entries; full: all of it), subtracts what it
sends from ``m`` (error feedback: what is not sent stays for later), exchanges ``q``, and
the parameter moves by the group's update rule applied to the decoded average
(:mod:`hf_flexdemo.updates`; DeMo's ``lr * sign(decoded)`` by default).
Between replication steps (``replicate_every > 1``) the gradient only accumulates in the
momentum and the parameters do not move, so every replica still holds the same model.
"""

from __future__ import annotations

import torch

from ..buckets import Bucket
from .base import ReplicationScheme


def momentum_dtype(param: torch.Tensor) -> torch.dtype:
    """16-bit momentum cannot hold decay * m + small: keep it in float32 for 16-bit parameters."""
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


class MomentumScheme(ReplicationScheme):
    """Base for schemes that replicate part of a decoupled momentum."""

    momentum_key = "momentum"

    @property
    def local_keys(self) -> tuple[str, ...]:
        return (self.momentum_key,)

    def init_state(self, bucket: Bucket) -> None:
        self.momentum(bucket)

    def momentum(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's momentum, ``(count, *shape)``."""
        return bucket.per_replica(self.momentum_key, momentum_dtype(bucket.slots[0].param))

    def accumulate(self, bucket: Bucket) -> torch.Tensor:
        """``m = decay * m + lr * grad``; returns the momentum (local, in place)."""
        m = self.momentum(bucket)
        m.mul_(bucket.group["decay"]).add_(bucket.grad.to(m.dtype), alpha=bucket.group["lr"])
        return m
