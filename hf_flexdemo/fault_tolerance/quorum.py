"""The step's quorum and its commit: join the live nodes, exchange, then every process of the node votes.

A node stops, with what to do, when the quorum cannot work for it: it cannot join one within
``quorum_timeout``, its recovery keeps failing (:data:`MAX_FAILED_JOINS`: the others wait for it in
each step's collective), its steps keep failing to commit (:data:`MAX_UNCOMMITTED`), or it would
quietly start over a job whose state left with its nodes (:func:`~.lighthouse.job_state_verdict`).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..config import FlexDeMoConfig
from .lighthouse import LighthouseView, job_state_verdict, lighthouse_status, read_lighthouse
from .node import FaultToleranceError, NodeIdentity

logger = logging.getLogger(__name__)

WAIT_NOTICE_S = 5.0
"""How often a node waiting for its quorum says so, and who is missing."""
MAX_UNCOMMITTED = 10
"""Steps in a row a node may fail to commit before it stops (a streak means the quorum cannot work)."""
MAX_FAILED_JOINS = 3
"""Quorums in a row this node may fail to join (its recovery or process group failed) before it stops.

While it fails, the other nodes wait up to ``ft_timeout`` in each step's collective for it, so
it gives up well before they would (``MAX_UNCOMMITTED``): relaunched, it tries afresh."""


VOTE_WAIT_EXCHANGES = 2
"""A process's commit vote waits this many ``ft_timeout`` for its node's other processes to vote.

A sibling whose exchange waits out ``ft_timeout`` (its peer on another node froze after this process's
peer had sent) votes that much later than this process, plus the skew between them; waiting only
``ft_timeout`` raised a ``TimeoutError`` that ended the node."""


class StepQuorum:
    """This node's quorum round of one step: joined by :meth:`join`, closed by :meth:`commit`."""

    def __init__(self, manager, identity: NodeIdentity, config: FlexDeMoConfig, rank: int):
        self._manager, self._identity, self._config, self._rank = manager, identity, config, rank
        self.round_open = False
        """Whether this step's quorum is joined and not yet committed."""
        self.met = False
        """Whether a quorum has formed yet."""
        self.uncommitted = 0
        """Steps in a row not committed."""
        self._why_uncommitted = ""  # why the last step did not commit
        self._failed_joins = 0  # quorums in a row this node failed to join
        self._resumed = False  # whether this node continues from a checkpoint
        self._job: LighthouseView | None = None  # the job as the Lighthouse saw it before this node joined
        self._settled = False  # whether this node has committed a step (then it holds the job's state)
        self.committed_node_steps = 0
        """Sum of the quorum's size over the steps this node committed since this process started."""

    def join(self) -> None:
        """Join this step's quorum: the node heals in it if it is behind. Stops the node after
        ``quorum_timeout``, or after :data:`MAX_FAILED_JOINS` quorums in a row it could not join."""
        if not self.met and self._rank == 0:
            self._job = read_lighthouse(self._identity.lighthouse)
        done = threading.Event()
        watcher = threading.Thread(target=self._say_while_waiting, args=(done,), daemon=True)
        watcher.start()
        try:
            self._manager.start_quorum()
        except FaultToleranceError:
            raise
        except Exception as e:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self._identity.name} could not join a quorum of min_replicas="
                f"{self._config.min_replicas} live nodes (quorum_timeout={self._config.quorum_timeout:g} s): "
                f"{type(e).__name__}: {e}. {lighthouse_status(self._identity.lighthouse)}. Stopping; every "
                "completed checkpoint is whole."
            ) from e
        finally:
            done.set()
        self.round_open = self.met = True
        error = self._manager.errored()
        if error is None:
            self._failed_joins = 0
            return
        # The quorum formed, but this node's recovery or process group set-up failed.
        self._failed_joins += 1
        if self._failed_joins >= MAX_FAILED_JOINS:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self._identity.name} failed to join {self._failed_joins} quorums in a "
                f"row ({error.original_exception}); it stops so that the other nodes are not held up. Relaunch "
                "it once the cause is fixed (a peer's host name must resolve from here, and one shard must "
                "transfer within ft_timeout)."
            )
        logger.warning(
            "FlexDeMo fault tolerance: %s could not join this step's quorum (%s); the step will be undone and "
            "it tries again at the next one.",
            self._identity.name,
            error.original_exception,
        )

    def _say_while_waiting(self, done: threading.Event) -> None:
        started = time.monotonic()
        while not done.wait(WAIT_NOTICE_S):
            logger.warning(
                "FlexDeMo fault tolerance: %s has waited %.0f s for a quorum of min_replicas=%d live nodes "
                "(stops after quorum_timeout=%g s). %s.",
                self._identity.name,
                time.monotonic() - started,
                self._config.min_replicas,
                self._config.quorum_timeout,
                lighthouse_status(self._identity.lighthouse),
            )

    def check_job_state(self) -> None:
        """Until its first commit, a node must not quietly start over a job whose state left with its nodes.

        The Lighthouse's view before this node joined is read on rank 0, which decides for the node.
        The quorum's committed steps (this node's after healing) below the last quorum's, with none
        of that quorum's other nodes still heartbeating, mean the state is gone.
        """
        if self._settled:  # also after a failed first heal: the nodes it was to heal from may leave
            return
        before, step = self._job, self._manager.current_step()
        verdict: list = [None]
        if self._rank == 0 and before is not None and before.job_step > step:
            now = read_lighthouse(self._identity.lighthouse)
            verdict[0] = job_state_verdict(before, now, self._identity.name, step, self._resumed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is None:
            return
        kind, message = verdict[0]
        if kind == "refuse":
            raise FaultToleranceError(message)
        if self._rank == 0:
            logger.warning(message)

    def commit(self, trained: bool) -> bool:
        """Every process of the node agrees whether the step stands; False: undo it (see
        :meth:`~.replicas.ManagedReplicas.commit`)."""
        self.round_open = False
        error = self._manager.errored()
        live = self._manager.num_participants()
        if self._vote():
            self.uncommitted = 0
            self._settled = True
            self.committed_node_steps += live if trained else 0
            return True
        self.uncommitted += 1
        if error:
            why = "its exchange with the quorum failed: a node left or timed out"
            logger.info("FlexDeMo fault tolerance: %s: %s", self._identity.name, error.original_exception)
        elif live < self._config.min_replicas:
            why = f"{live} live node(s), fewer than min_replicas={self._config.min_replicas}"
        else:
            why = "another process of this node failed the step"
        self._why_uncommitted = why
        if self.uncommitted > MAX_UNCOMMITTED:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self._identity.name} could not commit {self.uncommitted} steps in a "
                f"row (last: {why}). If too few nodes are live, start the Lighthouse with --min_replicas "
                f"{self._config.min_replicas} (the job's min_replicas) so that nodes wait for a quorum instead. "
                f"{lighthouse_status(self._identity.lighthouse)}."
            )
        if self._rank == 0:
            logger.warning(
                "FlexDeMo fault tolerance: %s did not commit this step (%s); the step is undone on this node (its "
                "batch is skipped) and training goes on.",
                self._identity.name,
                why,
            )
        return False

    def _vote(self) -> bool:
        """This process's vote; the node's decision once every process of it has voted."""
        wait = VOTE_WAIT_EXCHANGES * self._config.ft_timeout
        try:
            return self._manager.should_commit(timeout=timedelta(seconds=wait))
        except TimeoutError as e:  # deciding alone could commit on some processes of the node and not on others
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: process {self._rank} of {self._identity.name} waited {wait:g} s (twice "
                f"ft_timeout={self._config.ft_timeout:g}) for the node's other processes to vote on the step; one is "
                "stuck or far slower. If steps are this slow, raise ft_timeout; the node stops so that it can be "
                "relaunched and heal."
            ) from e

    def check_trained(self) -> None:
        """At the end of training: a node that failed every step it ran trained nothing, an error, not a quiet exit.

        A run shorter than the streak :meth:`commit` stops at would otherwise end as if it had trained.
        """
        if self._settled or not self.uncommitted:
            return
        raise FaultToleranceError(
            f"FlexDeMo fault tolerance: {self._identity.name} finished training without committing a step "
            f"(last: {self._why_uncommitted}); its parameters are where they started. If too few nodes were live, "
            f"start the Lighthouse with --min_replicas {self._config.min_replicas} (the job's min_replicas) so that "
            f"nodes wait for each other. {lighthouse_status(self._identity.lighthouse)}."
        )

    def resume(self, state: dict[str, int] | None) -> None:
        """Continue from a checkpoint: ``state`` is :meth:`state_dict` as it was saved (``None``: not saved)."""
        if state:
            self._manager.load_state_dict(state)
        self._resumed = True

    def state_dict(self) -> dict[str, int]:
        """torchft's committed-step count, for a checkpoint: a node resumed from it heals only if behind."""
        return self._manager.state_dict()
