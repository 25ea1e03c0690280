"""The optimizer's side of a quorum round: join it, commit the step or undo it, replay what the node missed.

:class:`QuorumRounds` is a mixin of :class:`~hf_flexdemo.FlexDeMo`. The optimizer talks to the
quorum only through :class:`~.replicas.ManagedReplicas` (``self._managed``); what it must do on
its own state is here: undo a step its node did not commit (:mod:`.replica_state`), log each
committed step for peers that fall behind and replay the steps this node missed (:mod:`.replay`),
and the rounds after the job's last step (:mod:`.closing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtensor_utils import local_tensor
from ..topology import ReplicaTopology
from .closing import ClosingRounds
from .replay import LoggedStep, ReplayLog
from .replica_state import ReplicaState, restore, undo_local_step


@dataclass(frozen=True)
class StepRound:
    """How one step meets the quorum of nodes."""

    in_quorum: bool = False
    """The step runs in a quorum round: its node commits it, or undoes it."""
    local: bool = False
    """torch's state creation under a quorum: the step stays on this node (it moves nothing)."""
    drop_gradient: bool = False
    """The gradient belongs to parameters that a heal replaced, or that a catch-up will move: it folds in nothing."""


class QuorumRounds(ClosingRounds, ReplicaState):
    """FlexDeMo under torchft: each step in a round of the quorum of live nodes (a mixin of the optimizer)."""

    def _init_quorum_rounds(self) -> None:
        self._managed = None  # fault tolerance: the ManagedReplicas that decide who the replicas are each step
        replayable = self.config.fault_tolerant and self.scheme.traits.replayable
        self._replay = ReplayLog(self.config.replay_steps if replayable else 0)  # steps a lagging peer may replay
        self._missed: list[LoggedStep] | None = None  # steps this node missed, replayed at its next commit

    def attach_managed(self, replicas) -> None:
        """Exchange with the live nodes of a torchft quorum (:class:`hf_flexdemo.fault_tolerance.ManagedReplicas`).

        Each node is its own job: parameters are FSDP2-sharded over the node's processes (or
        plain tensors with one process per node), and each node checkpoints its own state.
        Every step joins the quorum (if the caller has not yet, see ``begin()``), exchanges
        over its live replicas, and applies the update only if the node commits the step.
        """
        if self._topology is not None and self._topology.is_replicated:
            raise RuntimeError(
                "FlexDeMo: attach_managed() on an optimizer that already replicates over a device mesh dimension; "
                "with fault tolerance each node is its own job (one node per launch, no dp_replicate dimension)."
            )
        if self._store is None:
            self._set_topology(ReplicaTopology.single())
        self._managed = replicas
        replicas.register("flexdemo_optimizer", self.replica_state, self.load_replica_state)
        replicas.describe("flexdemo", self._describe_layout)

    @property
    def managed(self):
        """The :class:`~hf_flexdemo.fault_tolerance.ManagedReplicas` this optimizer exchanges through, or None."""
        return self._managed

    def begin_step(self) -> None:
        """Fault tolerance: join this step's quorum now, before the forward pass (no-op otherwise, and with
        ``join_quorum='when_ready'``, which joins in ``step()``).

        A node that is behind then takes a peer's parameters before computing its gradient.
        ``step()`` joins by itself if this was not called, one backward pass later.
        """
        if self._managed is not None and self.config.join_quorum == "before_forward":
            self._managed.begin()

    def _payload_before_quorum(self, sync_only: bool) -> bool:
        """Whether this training step computes its payload before asking for its quorum.

        With ``join_quorum='when_ready'`` a node asks once its payload is ready, so that once the quorum
        forms it holds its partners only for the heal and the exchange: a node that stalls while encoding
        would hold them in the collective. DeMo's local maths reads only the step's ``replicate`` flag,
        which is checked against the quorum's once joined (other schemes read the quorum's step or rank).
        """
        return (
            not sync_only
            and self._managed is not None
            and self.config.join_quorum == "when_ready"
            and self.scheme.traits.payload_first
            and self.config.rounding != "stochastic"
            and not self.config.overlap
            and not self._managed.round_open
            and any(self.state.values())
        )

    def _run_payload_first(self) -> bool:
        """A training step that encodes, then joins its quorum and exchanges (see :meth:`_payload_before_quorum`).

        The momentum takes this node's gradient at this node's learning rate, before a catch-up moves the
        hyperparameters on (the exchanged update is applied at the quorum's, as on every node). If the quorum
        turns out to need another payload (its step would not replicate, or a heal copied a peer's state),
        the encoding is undone and the step runs as it would have after joining.
        """
        buckets = self._bucketed()
        self._count_step(buckets)
        # The same local part as a step in its round (weight decay waits for the commit: no copy of the parameters)
        encoded = self._encode_step(buckets, False, self.topology, in_quorum=True, drop_gradient=False)
        joined = self._enter_round(False)
        if joined is None:  # the job finished meanwhile: this gradient would be a step past its end
            undo_local_step(encoded.undo)
            self._book.host_step = None
            return False
        ctx = self._context(self._this_step(), False, self.topology)
        if joined.drop_gradient or ctx.replicate != encoded.ctx.replicate:
            if not joined.drop_gradient:  # (a heal that copied a peer's state replaced the encoding with the rest)
                undo_local_step(encoded.undo)
            self._book.host_step = None  # the step counts went back, or are the peer's
            return self._run_in_round(joined, False)
        for moving, bucket in zip(encoded.buckets, buckets):  # the quorum's hyperparameters: a heal may have moved
            moving.group = dict(bucket.group)  # them on
        encoded.ctx, encoded.topology = ctx, self.topology  # the quorum's, now that it is known
        self._send(encoded)
        return ctx.replicate

    def _enter_round(self, sync_only: bool) -> StepRound | None:
        """How this step meets the quorum, joining its round if ``begin_step()`` did not; None: nothing to run.

        Without fault tolerance the step meets no quorum (and the topology is decided on first use).
        """
        managed = self._managed
        if self.config.fault_tolerant and managed is None:
            raise RuntimeError(
                "FlexDeMo: fault_tolerance='torchft' but no quorum is attached, so this node would train alone. "
                "The Trainer and Accelerate attach it; in your own loop call "
                "optimizer.attach_managed(hf_flexdemo.fault_tolerance.node_replicas(optimizer.config))."
            )
        first = next((p for group in self.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None:
            return None
        healed, in_quorum, local = False, False, False
        if managed is None:
            self.topology  # noqa: B018  (decides the topology and state layout on first use)
        elif not managed.round_open and not any(self.state.values()) and self._is_state_creation():
            local = True
        else:
            healed = self._join_round(sync_only, first)
            if healed is None:
                return None
            in_quorum = True
        # A gradient taken on parameters that a heal replaced, or that a catch-up will move, folds in nothing;
        # but a node that joins when ready is late on purpose: its gradient counts, at most replay_steps old.
        late_but_counted = self.config.join_quorum == "when_ready" and self._missed is not None
        stale = (healed or self._missed is not None) and not late_but_counted
        return StepRound(in_quorum=in_quorum, local=local, drop_gradient=stale)

    def _join_round(self, sync_only: bool, first: torch.Tensor) -> bool | None:
        """Join this step's round: whether it replaced the parameters after the gradient was taken, or None if
        the round ends here (nothing to exchange, or the job has finished). ``first``: the first trainable
        parameter."""
        managed = self._managed
        if sync_only and self.config.join_quorum == "when_ready" and not self._needs_sync():
            # Nothing to exchange, so no round: a node late for a quorum could otherwise meet this round with
            # its training step, whose collectives are not this round's. It catches up at a training step.
            return None
        if sync_only and "step" not in self.state.get(first, {}):
            return None  # nothing trained yet
        # The round may open here, after the backward pass, and replace the parameters: this
        # gradient then belongs to the old ones, so the step folds in nothing.
        healed = managed.begin() and not sync_only
        if self.config.join_quorum == "when_ready" and managed.agree_on_finished():
            # This node healed from one that finished training: the job's last step has committed. It
            # catches up to it and finishes too; its own gradient would be a step past the end.
            self._closing_round()
            return None
        if sync_only and not self._needs_sync():
            # Decided after healing, so every node decides alike; the round closes with nothing sent.
            self._empty_round()
            return None
        return healed

    def _is_state_creation(self) -> bool:
        """torch's distributed checkpoint creates state with one step of lr 0 and zero gradients: under a
        quorum that step stays local (it moves nothing), so loading a checkpoint does not start a round."""
        params = [p for group in self.param_groups for p in group["params"]]
        return all(float(group["lr"]) == 0.0 for group in self.param_groups) and all(
            p.grad is None or not bool(local_tensor(p.grad).any()) for p in params
        )

    def _commit_round(self, undo: list) -> bool:
        """The node votes on the step. Not committed, the step is undone (``undo``), here as on every other node;
        committed, this node first replays the steps it missed."""
        if not self._managed.commit():
            restore(undo)  # the step did not happen, on this node or any other
            self._book.host_step = None  # the step counts went back: read them again
            return False
        with self._managed.clock.timing("catch_up"):
            self._catch_up()
        return True

    def _empty_round(self) -> bool:
        """Commit a round that changes nothing (the node still catches up on steps it missed)."""
        managed = self._managed
        if not managed.commit(trained=False):
            return False
        with managed.clock.timing("catch_up"):
            self._catch_up()
        self._replay.record(LoggedStep(managed.step, None, [], [], [], trained=False))
        return True
