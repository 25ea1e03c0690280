"""One step's exchange between starting its collective and applying what came back.

A step packs every bucket's payload into the scheme's one collective (:mod:`hf_flexdemo.wire`),
and each bucket's ``apply`` later takes its own slice of what was received. The collective is a real
process group's, the local stand-in of simulated replicas (:mod:`hf_flexdemo.simulated_replicas`), or
either left in flight until the next step (``overlap``). A wrapper around the step (fault tolerance)
may hold it back once complete: its :class:`StepGuard` decides whether the step is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..buckets import Bucket
from ..schemes import Collective, StepContext
from ..topology import ReplicaTopology
from ..wire import Exchange, all_gather_packed, all_reduce_mean_packed


class StepGuard(Protocol):
    """What a wrapper around the step does once the step's exchange is complete (:mod:`hf_flexdemo.fault_tolerance`)."""

    def settle(self) -> bool:
        """Whether the step is applied; if not, the guard has undone its local part."""

    def applied(self, job: InFlight, parts: list[Any]) -> None:
        """The step was applied, with ``parts`` as each bucket received them."""


class Unguarded:
    """No wrapper: every step is applied."""

    def settle(self) -> bool:
        return True

    def applied(self, job: InFlight, parts: list[Any]) -> None:
        pass


UNGUARDED = Unguarded()


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
    guard: StepGuard = UNGUARDED
    """What decides, once the exchange is complete, whether the step is applied."""
    decay_in_rules: bool = False
    """Weight decay waits for the rules, which fold it into their pass over the parameters (after the guard)."""
    training: bool = True
    """A training step, not a ``synchronize()`` round."""


@dataclass
class EncodedStep:
    """One step's local part, done: every bucket's payload, ready for the exchange (:meth:`FlexDeMo.send`)."""

    buckets: list[Bucket]
    payloads: list[list[torch.Tensor]]
    grad_bytes: list[int]
    ctx: StepContext
    topology: ReplicaTopology
    guard: StepGuard
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
