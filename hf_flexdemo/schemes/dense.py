"""Full sync and none: the two ends of the range, with the same update rule as the others.

- ``full``: the whole momentum travels with a dense all-reduce. Everything is sent, so
  error feedback empties the momentum and, with ``replicate_every=1``, each step is the
  update rule on the mean gradient (``p -= lr * sign(mean gradient)`` with ``update='sign'``):
  a dense gradient all-reduce, the baseline.
- ``none``: nothing leaves the node; each replica takes the same step from its own
  gradient. Replicas drift apart: use it for one node or as an ablation.

One replica: both apply the update rule to the replica's own momentum (which accumulates
between replication steps when ``replicate_every > 1``).
"""

from __future__ import annotations

import torch

from ..buckets import Bucket
from ..scheme_traits import SchemeTraits
from .base import Collective, Decoded, StepContext
from .momentum import MomentumScheme


class FullScheme(MomentumScheme):
    name = "full"
    collective = Collective.ALL_REDUCE
    traits = SchemeTraits(per_step=True)

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        m = self.accumulate(bucket)
        if not ctx.replicate:
            return []
        sent = m.to(self.wire_dtype(bucket), copy=True).view(-1)
        m.sub_(sent.view(m.shape).to(m.dtype))
        bucket.carried = True
        return [sent]

    def apply(self, bucket: Bucket, received: list[torch.Tensor], ctx: StepContext) -> Decoded | None:
        # A copy: the rules work in place, and a catch-up log keeps what was received (see fault_tolerance.replay).
        return Decoded(bucket, received[0].clone()) if bucket.carried else None


class NoneScheme(FullScheme):
    name = "none"
    collective = Collective.NONE
    traits = SchemeTraits(sends=False)

    def replicas_match(self, state, step: int) -> bool:
        return False
