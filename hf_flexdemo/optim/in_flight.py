"""One step's exchange between starting its collective and applying what came back.

A step packs every bucket's payload into the scheme's one collective (:mod:`hf_flexdemo.wire`),
and each bucket's ``apply`` later takes its own slice of what was received. With ``overlap`` the
exchange stays in flight until the next step; under a quorum it also carries what to undo if the
node does not commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..buckets import Bucket
from ..schemes import Collective, StepContext
from ..topology import ReplicaTopology
from ..wire import Exchange, all_gather_packed, all_reduce_mean_packed


@dataclass
class InFlight:
    """One step's exchange: started, not yet applied (at once, or next step with ``overlap``)."""

    buckets: list[Bucket]
    payloads: list[list[torch.Tensor]]
    exchange: Exchange
    ctx: StepContext
    bounds: list[tuple[int, int]]
    """Where each bucket's tensors sit in the packed list."""
    grad_bytes: list[int]
    """One parameter's gradient size per bucket (the dense baseline); the gradients themselves are released."""
    undo: list | None = None
    """Fault tolerance: what the step changed before its exchange, restored if the node does not commit."""
    decay_in_rules: bool = False
    """Weight decay waits for the rules, which fold it into their pass over the parameters (under a quorum: after
    the commit and any catch-up)."""
    training: bool = True
    """A training step, not a ``synchronize()`` round."""


@dataclass
class EncodedStep:
    """One step's local part, done: every bucket's payload, ready for the exchange (:meth:`FlexDeMo._send`)."""

    buckets: list[Bucket]
    payloads: list[list[torch.Tensor]]
    grad_bytes: list[int]
    ctx: StepContext
    topology: ReplicaTopology
    undo: list | None
    decay_in_rules: bool
    training: bool


def start_exchange(
    collective: Collective,
    buckets: list[Bucket],
    payloads: list[list[torch.Tensor]],
    grad_bytes: list[int],
    ctx: StepContext,
    *,
    async_op: bool,
    topology: ReplicaTopology,
) -> InFlight:
    """Start the step's one packed collective."""
    flat = [t for payload in payloads for t in payload]
    bounds, start = [], 0
    for payload in payloads:
        bounds.append((start, start + len(payload)))
        start += len(payload)
    if not ctx.replicate or collective is Collective.NONE or not flat:
        exchange = Exchange.done(None)
    elif collective is Collective.ALL_GATHER:
        exchange = all_gather_packed(flat, topology, async_op=async_op)
    else:
        exchange = all_reduce_mean_packed(flat, topology, async_op=async_op)
    return InFlight(buckets, payloads, exchange, ctx, bounds, grad_bytes)


def split_received(received: Any, job: InFlight, collective: Collective) -> list[Any]:
    """What each bucket's ``apply`` gets: per replica (all-gather), the mean, or its own payload."""
    if not job.ctx.replicate:
        return [None] * len(job.payloads)
    if received is None:  # nothing crossed nodes (scheme none, or no payload at all)
        return job.payloads
    if collective is Collective.ALL_GATHER:
        return [[replica[a:b] for replica in received] for a, b in job.bounds]
    return [received[a:b] for a, b in job.bounds]
