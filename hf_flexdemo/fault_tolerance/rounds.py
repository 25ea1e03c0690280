"""The optimizer's side of a quorum round: join it, commit the step or undo it, replay what the node missed.

:class:`QuorumRounds` is a part of :class:`~hf_flexdemo.FlexDeMo`, which owns one. It talks to the
quorum only through :class:`~.replicas.ManagedReplicas` (``managed``, None until the optimizer is
attached to one) and to the optimizer only through :class:`~.pipeline.StepPipeline`. What the node
does on the optimizer's state is in :class:`~.replica_state.ReplicaState`: undo a step it did not
commit, log each committed step for peers that fall behind, replay the steps it missed. The rounds
after the job's last step are at the end (closing rounds, see :mod:`.closing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dtensor_utils import local_tensor
from ..topology import parameter_fingerprint
from .pipeline import StepPipeline
from .replica_state import ReplicaState, restore


@dataclass(frozen=True)
class StepRound:
    """How one step meets the quorum of nodes."""

    in_quorum: bool = False
    """The step runs in a quorum round: its node commits it, or undoes it."""
    local: bool = False
    """torch's state creation under a quorum: the step stays on this node (it moves nothing)."""
    drop_gradient: bool = False
    """The gradient belongs to parameters that a heal replaced, or that a catch-up will move: it folds in nothing."""


class QuorumRounds:
    """Each step of ``pipeline`` (the optimizer) in a round of the quorum of live nodes, under torchft."""

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
        """How this step meets the quorum, joining its round if ``begin_step()`` did not; None: nothing to run.

        Without fault tolerance the step meets no quorum.
        """
        managed, pipeline = self.managed, self.pipeline
        if pipeline.config.fault_tolerant and managed is None:
            raise RuntimeError(
                "FlexDeMo: fault_tolerance='torchft' but no quorum is attached, so this node would train alone. "
                "The Trainer and Accelerate attach it; in your own loop call "
                "optimizer.attach_managed(hf_flexdemo.fault_tolerance.node_replicas(optimizer.config))."
            )
        first = next((p for group in pipeline.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None:
            return None
        if managed is None:
            return StepRound()
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
            self.pipeline.forget_step_count()  # the step counts went back
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
