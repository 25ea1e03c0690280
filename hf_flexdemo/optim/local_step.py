"""A step's local part, before anything crosses nodes: each bucket's gradient folded into its state, and its payload.

Every path of a step runs it: a node's own step, each simulated replica's (``simulate_replicas``), and a node under
fault tolerance (which only takes a copy first, to undo it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..buckets import Bucket
from ..config import FlexDeMoConfig
from ..schemes import Decoded, ReplicationScheme, StepContext
from ..simulated_replicas import ReplicaGradients, SimulatedTopology
from ..topology import ReplicaTopology
from ..wire import nbytes
from .apply_rules import RuleApplier
from .in_flight import start_exchange


def step_context(
    config: FlexDeMoConfig, scheme: ReplicationScheme, step: int, *, sync_only: bool, topology: ReplicaTopology
) -> StepContext:
    """What every bucket's maths reads of step ``step`` (1-based) on ``topology``'s replica."""
    ctx = StepContext(
        step=step,
        replicate=scheme.is_replication_step(step, forced=sync_only),
        replicas=topology.size,
        rank=topology.rank,
    )
    if config.rounding == "stochastic":  # each replica its own draws: rounding errors independent
        ctx.noise = torch.Generator().manual_seed((config.seed * 1_000_003 + step) * 1_009 + topology.rank)
    return ctx


def local_payloads(
    applier: RuleApplier,
    stepping: list[Bucket],
    ctx: StepContext,
    *,
    sync_only: bool,
    drop_gradient: bool,
    grads: dict | None = None,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Each bucket's local maths (momentum, encode): its payload, and one gradient's size (the dense baseline).
    ``grads``: a simulated replica's gradients by parameter (None: ``.grad``)."""
    scheme = applier.scheme
    if scheme.traits.outer_steps and not sync_only:
        _inner_steps(applier, stepping, ctx, drop_gradient, grads)
    payloads, grad_bytes = [], []
    for bucket in stepping:  # one bucket's gradients at a time: they are folded into its state
        bucket.grads = None if sync_only else bucket.gradients(drop_gradient, grads)
        payloads.append(scheme.local_step(bucket, ctx))
        grad_bytes.append(nbytes(bucket.grads[0]) if bucket.grads is not None else 0)
        bucket.release_grads()
    return payloads, grad_bytes


def _inner_steps(
    applier: RuleApplier, stepping: list[Bucket], ctx: StepContext, drop_gradient: bool, grads: dict | None
) -> None:
    """Outer-step schemes: each bucket's step on this replica's own gradient, before its payload; what the scheme
    leaves to the group's rule (``update='orthogonal'``: the matrices) goes to the rules in batches."""

    def own_updates() -> Iterator[Decoded]:
        for bucket in stepping:
            bucket.grads = bucket.gradients(drop_gradient, grads)
            inner = applier.scheme.inner_step(bucket, ctx)
            bucket.release_grads()
            if inner is not None:
                yield inner

    applier.apply_in_batches(own_updates(), ctx)


def other_replicas_step(
    config: FlexDeMoConfig,
    applier: RuleApplier,
    simulated: ReplicaGradients,
    stepping: list[Bucket],
    step: int,
    sync_only: bool,
) -> tuple[SimulatedTopology, dict | None]:
    """``simulate_replicas``: replicas 1 to R-1 each take their gradient into their own state and post their
    payload to the local collective. Returns replica 0's topology and gradients, for the node's own path."""
    topologies = SimulatedTopology.replicas(config.simulate_replicas)
    sources = [None] * len(topologies) if sync_only else simulated.for_step()
    for topology, grads in zip(topologies[1:], sources[1:]):
        ctx = step_context(config, applier.scheme, step, sync_only=sync_only, topology=topology)
        replica = [bucket.for_replica(topology.rank) for bucket in stepping]
        payloads, grad_bytes = local_payloads(
            applier, replica, ctx, sync_only=sync_only, drop_gradient=False, grads=grads
        )
        start_exchange(applier.scheme.collective, replica, payloads, grad_bytes, ctx, async_op=False, topology=topology)
    return topologies[0], sources[0]
