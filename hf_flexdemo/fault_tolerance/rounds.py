"""Fault tolerance wrapped around FlexDeMo's step, in torchft's shape: join a quorum round, run the optimizer's
step inside it, let the node vote, undo the step if it did not commit, replay what the node missed.

:func:`wrap_optimizer` puts a :class:`QuorumRounds` around an optimizer: the optimizer's ``step()`` and
``synchronize()`` then run through :meth:`QuorumRounds.run`, which calls the optimizer's own one path
(``begin``, ``encode``, ``send``) with a guard (:class:`_Undo`) that votes once the exchange is complete. The
wrapper talks to the quorum only through :class:`~.replicas.ManagedReplicas` (``managed``) and to the optimizer
only through :class:`~.pipeline.StepPipeline`. What the node does on the optimizer's state is in
:class:`~.replica_state.ReplicaState`: undo a step it did not commit, log each committed step for peers that fall
behind, replay the steps it missed. The rounds after the job's last step are at the end (closing rounds, see
:mod:`.closing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..buckets import Bucket
from ..dtensor_utils import local_tensor
from ..optim.in_flight import EncodedStep, InFlight
from ..optim.local_step import step_context
from ..topology import ReplicaTopology, parameter_fingerprint
from .pipeline import StepPipeline
from .replica_state import ReplicaState, restore, snapshot, undo_local_step


def wrap_optimizer(optimizer, replicas) -> QuorumRounds:
    """Run ``optimizer``'s steps (a :class:`~hf_flexdemo.FlexDeMo`) in rounds of the live nodes of ``replicas`` (a
    :class:`~.replicas.ManagedReplicas`, see :func:`~.replicas.node_replicas`).

    Each node is its own job: parameters are FSDP2-sharded over the node's processes (or plain tensors with one
    process per node), and each node checkpoints its own state. Every step joins the quorum (if the caller has not
    yet, see :meth:`QuorumRounds.begin_step`), exchanges over its live replicas, and applies the update only if the
    node commits the step. Returns the wrapper (also ``optimizer.wrapped_by``).
    """
    if optimizer.store is not None and optimizer.topology.is_replicated:
        raise RuntimeError(
            "FlexDeMo: fault tolerance wraps an optimizer that already replicates over a device mesh dimension; "
            "with fault tolerance each node is its own job (one node per launch, no dp_replicate dimension)."
        )
    if optimizer.store is None:  # this node's own layout, also for a state loaded before (it meets the others
        optimizer.topology  # noqa: B018  (through the quorum's group)
    rounds = QuorumRounds(optimizer)
    rounds.attach(replicas)
    optimizer.wrapped_by = rounds
    # Through the wrapper's own methods, so that a subclass (or a test's fault injection) serves through its own
    replicas.healing.register("flexdemo_optimizer", rounds.replica_state, rounds.load_replica_state)
    replicas.healing.describe("flexdemo", rounds.replica.describe_layout)
    return rounds


@dataclass(frozen=True)
class StepRound:
    """How one step meets the quorum of nodes."""

    in_quorum: bool = False
    """The step runs in a quorum round: its node commits it, or undoes it."""
    local: bool = False
    """torch's state creation under a quorum: the step stays on this node (it moves nothing)."""
    drop_gradient: bool = False
    """The gradient belongs to parameters that a heal replaced, or that a catch-up will move: it folds in nothing."""


def managed_replicas(optimizer):
    """The :class:`~.replicas.ManagedReplicas` a wrapped FlexDeMo exchanges through, else None (also for None or
    another optimizer)."""
    wrapper = getattr(optimizer, "wrapped_by", None)
    return wrapper.managed if wrapper is not None else None


class QuorumRounds:
    """Each step of ``pipeline`` (the optimizer) in a round of the quorum of live nodes, under torchft.

    Built alone (no ``replicas`` attached), it serves and takes the optimizer's state as a peer would
    (:meth:`replica_state`, :meth:`load_replica_state`).
    """

    def __init__(self, pipeline: StepPipeline):
        self.pipeline: StepPipeline = pipeline
        config = pipeline.config
        replayable = config.fault_tolerant and pipeline.scheme.traits.replayable
        self.replica = ReplicaState(pipeline, config.replay_steps if replayable else 0)
        """The optimizer's state as peers exchange it (copies, replay, catch-up)."""
        self.managed = None
        """The :class:`~.replicas.ManagedReplicas` that decide who the replicas are each step, once attached."""

    def attach(self, replicas) -> None:
        """Meet the quorum of ``replicas`` (a :class:`~.replicas.ManagedReplicas`) from the next step on."""
        self.managed = self.replica.managed = replicas

    # -- the optimizer's side (StepWrapper) ----------------------------------------------

    def run(self, sync_only: bool) -> bool:
        """One step of the optimizer (``sync_only``: a round of ``synchronize()``) in this node's round of the
        quorum; whether it exchanged across nodes."""
        if self.encodes_first(sync_only):
            return self._run_payload_first()
        joined = self.enter(sync_only=sync_only)
        if joined is None:
            return False
        return self._run_in_round(joined, sync_only=sync_only)

    def topology(self) -> ReplicaTopology:
        """The live replicas of this step's quorum."""
        return self.managed.topology()

    def fingerprints(self, params: list[torch.Tensor]) -> list[int]:
        """Checksums of ``params`` on the live replicas that committed the most steps (one that missed a commit
        heals at its next quorum), or ``[]`` if the comparison itself failed."""
        return self.managed.fingerprints_of_leaders(parameter_fingerprint(params), self.steps_missed())

    def replica_state(self) -> dict[str, Any]:
        """What a peer that is behind needs from this replica (see :meth:`.ReplicaState.serve`)."""
        return self.replica.serve()

    def load_replica_state(self, peer: dict[str, Any]) -> None:
        """Take a peer's parameters and shared state, or the steps to replay; this replica's own momentum stays."""
        self.replica.take(peer)

    def _this_step(self) -> int:
        """The step number the replicas pick alike (random's entries, replicate_every's exchanges): steps still
        to replay count."""
        return self.pipeline.steps_taken() + self.steps_to_replay()

    def _undo(self, stepping: list[Bucket], sync_only: bool, decay_in_rules: bool) -> _Undo:
        """The guard of a step in a round: a copy of what its local part changes (no copy of the parameters when
        weight decay waits for the rules, which run after the vote)."""
        scheme = self.pipeline.scheme
        return _Undo(self, snapshot(stepping, scheme, undo_step=not sync_only, with_params=not decay_in_rules))

    def _run_in_round(self, joined: StepRound, *, sync_only: bool) -> bool:
        """The step once it knows how it meets the quorum (``joined``)."""
        pipeline = self.pipeline
        buckets = pipeline.begin(sync_only, must_run=joined.in_quorum)
        if buckets is None:
            return False
        topology = ReplicaTopology.single() if joined.local else self.topology()
        encoded = pipeline.encode(
            buckets,
            sync_only=sync_only,
            topology=topology,
            step=self._this_step(),
            drop_gradient=joined.drop_gradient,
            guard=self._undo if joined.in_quorum else None,
        )
        return pipeline.send(encoded)

    def _run_payload_first(self) -> bool:
        """A training step that encodes, then joins its quorum and exchanges (see :meth:`encodes_first`).

        The momentum takes this node's gradient at this node's learning rate, before a catch-up moves the
        hyperparameters on (the exchanged update is applied at the quorum's, as on every node). If the quorum
        turns out to need another payload (its step would not replicate, or a heal copied a peer's state),
        the encoding is undone and the step runs as it would have after joining.
        """
        pipeline = self.pipeline
        buckets = pipeline.begin(False)
        # The same local part as a step in its round (weight decay waits for the commit: no copy of the parameters)
        encoded: EncodedStep = pipeline.encode(
            buckets, sync_only=False, topology=self.topology(), step=self._this_step(), guard=self._undo
        )
        joined = self.enter(sync_only=False)
        if joined is None:  # the job finished meanwhile: this gradient would be a step past its end
            undo_local_step(encoded.guard.saved)
            pipeline.book.forget_step_count()  # the step counts went back
            return False
        ctx = step_context(
            pipeline.config, pipeline.scheme, self._this_step(), sync_only=False, topology=self.topology()
        )
        if joined.drop_gradient or ctx.replicate != encoded.ctx.replicate:
            if not joined.drop_gradient:  # (a heal that copied a peer's state replaced the encoding with the rest)
                undo_local_step(encoded.guard.saved)
            pipeline.book.forget_step_count()  # the step counts went back, or are the peer's
            return self._run_in_round(joined, sync_only=False)
        for moving, bucket in zip(encoded.buckets, buckets):  # the quorum's hyperparameters: a heal may have moved
            moving.group = dict(bucket.group)  # them on
        encoded.ctx, encoded.topology = ctx, self.topology()  # the quorum's, now that it is known
        return pipeline.send(encoded)

    def begin_step(self) -> None:
        """Join this step's quorum now, before the forward pass, with ``join_quorum='before_forward'``."""
        if self.managed is not None and self.pipeline.config.join_quorum == "before_forward":
            self.managed.begin()

    def steps_to_replay(self) -> int:
        """Training steps this node missed and has not replayed yet."""
        return self.replica.steps_to_replay()

    def steps_missed(self) -> int:
        """Rounds this node missed and has not replayed yet (training steps or not)."""
        return len(self.replica.missed or ())

    def encodes_first(self, sync_only: bool) -> bool:
        """Whether this training step computes its payload before asking for its quorum.

        With ``join_quorum='when_ready'`` a node asks once its payload is ready, so that once the quorum
        forms it holds its partners only for the heal and the exchange: a node that stalls while encoding
        would hold them in the collective. DeMo's local maths reads only the step's ``replicate`` flag,
        which is checked against the quorum's once joined (other schemes read the quorum's step or rank).
        """
        config = self.pipeline.config
        return (
            not sync_only
            and self.managed is not None
            and config.join_quorum == "when_ready"
            and self.pipeline.scheme.traits.payload_first
            and config.rounding != "stochastic"
            and not config.overlap
            and not self.managed.quorum.round_open
            and any(self.pipeline.state.values())
        )

    def enter(self, *, sync_only: bool) -> StepRound | None:
        """How this step meets the quorum, joining its round if ``begin_step()`` did not; None: nothing to run."""
        managed, pipeline = self.managed, self.pipeline
        first = next((p for group in pipeline.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None:
            return None
        healed, in_quorum, local = False, False, False
        if not managed.quorum.round_open and not any(pipeline.state.values()) and self._is_state_creation():
            local = True
        else:
            healed = self._join(sync_only, first)
            if healed is None:
                return None
            in_quorum = True
        # A gradient taken on parameters that a heal replaced, or that a catch-up will move, folds in nothing;
        # but a node that joins when ready is late on purpose: its gradient counts, at most replay_steps old.
        missed = self.replica.missed is not None
        late_but_counted = pipeline.config.join_quorum == "when_ready" and missed
        stale = (healed or missed) and not late_but_counted
        return StepRound(in_quorum=in_quorum, local=local, drop_gradient=stale)

    def _join(self, sync_only: bool, first: torch.Tensor) -> bool | None:
        """Join this step's round: whether it replaced the parameters after the gradient was taken, or None if
        the round ends here (nothing to exchange, or the job has finished). ``first``: the first trainable
        parameter."""
        managed, pipeline = self.managed, self.pipeline
        when_ready = pipeline.config.join_quorum == "when_ready"
        if sync_only and when_ready and not pipeline.needs_sync():
            # Nothing to exchange, so no round: a node late for a quorum could otherwise meet this round with
            # its training step, whose collectives are not this round's. It catches up at a training step.
            return None
        if sync_only and "step" not in pipeline.state.get(first, {}):
            return None  # nothing trained yet
        # The round may open here, after the backward pass, and replace the parameters: this
        # gradient then belongs to the old ones, so the step folds in nothing.
        healed = managed.begin() and not sync_only
        if when_ready and managed.end.agree_on_finished():
            # This node healed from one that finished training: the job's last step has committed. It
            # catches up to it and finishes too; its own gradient would be a step past the end.
            self._closing_round()
            return None
        if sync_only and not pipeline.needs_sync():
            # Decided after healing, so every node decides alike; the round closes with nothing sent.
            self._empty_round()
            return None
        return healed

    def _is_state_creation(self) -> bool:
        """torch's distributed checkpoint creates state with one step of lr 0 and zero gradients: under a
        quorum that step stays local (it moves nothing), so loading a checkpoint does not start a round."""
        groups = self.pipeline.param_groups
        params = [p for group in groups for p in group["params"]]
        return all(float(group["lr"]) == 0.0 for group in groups) and all(
            p.grad is None or not bool(local_tensor(p.grad).any()) for p in params
        )

    def commit(self, undo: list) -> bool:
        """The node votes on the step. Not committed, the step is undone (``undo``), here as on every other node;
        committed, this node first replays the steps it missed."""
        if not self.managed.commit():
            restore(undo)  # the step did not happen, on this node or any other
            self.pipeline.book.forget_step_count()  # the step counts went back: read them again
            return False
        with self.managed.clock.timing("catch_up"):
            self.replica.catch_up()
        return True

    def _empty_round(self) -> bool:
        """Commit a round that changes nothing (the node still catches up on steps it missed)."""
        managed = self.managed
        if not managed.commit(trained=False):
            return False
        with managed.clock.timing("catch_up"):
            self.replica.catch_up()
        self.replica.log_empty_round()
        return True

    # -- the end of a job (see .closing) ------------------------------------------------

    def finish_training(self) -> None:
        """With ``join_quorum='when_ready'``: stay while a live node is still on its last step, so that the late
        one catches up and every node ends on the same parameters (:meth:`~.replicas.ManagedReplicas.close`)."""
        if self.managed is not None and self.pipeline.config.join_quorum == "when_ready":
            self.pipeline.flush()
            self.managed.close(self._closing_round)

    def _closing_round(self) -> bool:
        """A round after the job's last step: nothing is sent; late nodes catch up, then every node compares.
        Returns whether it committed (if not, this node has not caught up yet)."""
        committed = self._empty_round()
        self.managed.end.behind_at_close = not committed
        if not committed:
            return False
        params = [p for group in self.pipeline.param_groups for p in group["params"]]
        prints = self.managed.fingerprints_of_leaders(parameter_fingerprint(params), closing=True)
        differ = torch.tensor([int(len(set(prints)) > 1)], device=self.managed.device)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every process of the node stops, or none
            dist.all_reduce(differ, op=dist.ReduceOp.MAX)
        if differ.item():
            raise RuntimeError(
                f"FlexDeMo fault tolerance: the nodes end training with different parameters (checksums on this "
                f"process's shard: {prints}) although the late ones caught up: the nodes split (a node trained steps "
                "the others did not see) or a kernel is not deterministic. Each node's last checkpoint is whole; take "
                "the one of the node that trained in the largest quorums."
            )
        return True


class _Undo:
    """The guard of a step in a quorum round (:class:`~hf_flexdemo.optim.in_flight.StepGuard`): once the exchange is
    complete the node votes; not committed, the step is undone from ``saved``; applied, it is logged for peers."""

    def __init__(self, rounds: QuorumRounds, saved: list):
        self.rounds = rounds
        self.saved = saved

    def settle(self) -> bool:
        return self.rounds.commit(self.saved)

    def applied(self, job: InFlight, parts: list[Any]) -> None:
        self.rounds.replica.log(job.buckets, parts, job.ctx, trained=job.training)
