"""The end of a job: closing rounds, so that a node late for the job's last step ends on the same model.

With ``join_quorum='when_ready'`` the job's last step can commit without a late node; were the
others to leave, it would commit a last step of its own. So a node that finished training stays
(:meth:`JobEnd.close`) and joins a closing round whenever one waits at the Lighthouse. Nothing is
exchanged in it: the late node heals from a finished one, learns from it that the job has finished
(:data:`ROUND_STATE_KEY`), catches up, drops its own last gradient, and every node of the round
compares parameter checksums (:meth:`.rounds.QuorumRounds.finish_training`, the optimizer's side). A node that still
ends apart says so in one line (:func:`ending_note`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import FlexDeMoConfig
from .lighthouse import node_of, read_lighthouse
from .node import FaultToleranceError, NodeIdentity

logger = logging.getLogger(__name__)

ROUND_STATE_KEY = "flexdemo_round"
"""The second entry of the state a healing node receives: whether the peer has finished training (the round is
then a closing round), and which nodes it knows to have finished."""
CLOSING_POLL_S = 0.2
"""How often a node that finished training looks for a late node waiting to catch up."""


class JobEnd:
    """Whether this node has finished training, and the closing rounds it then joins."""

    def __init__(self, manager, identity: NodeIdentity, config: FlexDeMoConfig, rank: int, device: torch.device):
        self._manager, self._identity, self._config, self._rank, self._device = manager, identity, config, rank, device
        self.finished = False
        """Whether this node has finished training: every round it joins from then on is a closing round."""
        self._final_step = 0  # torchft's committed steps when the job's last training step had committed
        self._finished_nodes: set[str] = set()  # nodes known to have finished training
        self.behind_at_close = False
        """Whether this node's last closing round failed to commit: it has not caught up yet."""
        self._closed = False  # whether close() ran to its end since training started
        manager.register_state_dict_fn(ROUND_STATE_KEY, self._take_round, self._serve_round)

    def _serve_round(self) -> dict[str, Any]:
        return {"finished": self.finished, "nodes": sorted(self._finished_nodes)}

    def _take_round(self, peer: dict[str, Any]) -> None:
        if peer["finished"]:
            self.finished = True
            self._finished_nodes.update(peer["nodes"])

    def start_training(self) -> None:
        """A new training run in this process (a second ``train()``): its rounds train again."""
        self.finished, self._final_step, self.behind_at_close, self._closed = False, 0, False, False
        self._finished_nodes.clear()

    @property
    def ended_alike(self) -> frozenset[str]:
        """The nodes known to end on this node's model, once it has closed: those of its last committed round,
        and those that finished in a round after the job's last step (a closing round commits only where its
        nodes' checksums agree). Empty before :meth:`close` or while behind."""
        if not self._closed or self.behind_at_close:
            return frozenset()
        return frozenset(self._finished_nodes)

    def joined(self) -> None:
        """After joining a round: a late node that healed from one that finished has finished too."""
        if self.finished and not self._final_step:
            self._final_step = self._manager.current_step()

    def agree_on_finished(self) -> bool:
        """Whether any process of this node healed from a node that finished (then all of them close).

        Each process takes the peer's state on its own; one whose recovery failed would otherwise train while
        the others close, and the node's collectives would no longer match."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(self.finished)], device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.finished = bool(flag.item())
        return self.finished

    def close(self, begin: Callable[[], Any], closing_round: Callable[[], bool], members, behind: bool) -> None:
        """Stay while a live node is still on its last step (see :meth:`~.replicas.ManagedReplicas.close`).

        ``begin`` joins a round, ``closing_round`` commits it; ``members`` are the nodes of this node's last
        quorum, and ``behind`` says whether its last training step failed to commit.
        """
        self.finished = True
        self._final_step = self._final_step or self._manager.current_step()
        # A last training step that did not commit here leaves this node behind the others: it catches up too.
        self.behind_at_close = self.behind_at_close or behind
        self._finished_nodes.update(members)
        deadline = time.monotonic() + self._config.quorum_timeout
        said = False
        while True:
            action, training = self._closing_action(deadline)
            if action == "round":
                try:
                    begin()
                except FaultToleranceError as e:  # the others left meanwhile: nothing to catch up from
                    logger.warning(
                        "FlexDeMo fault tolerance: %s: no closing round after training: %s", self._identity.name, e
                    )
                    return
                self.behind_at_close = not closing_round()
            elif action == "wait":
                if not said and self._rank == 0:
                    logger.warning(
                        "FlexDeMo fault tolerance: %s finished training and stays for %s, still on its last step "
                        "(at most quorum_timeout=%g s), so that it ends on the same model.",
                        self._identity.name,
                        ", ".join(training),
                        self._config.quorum_timeout,
                    )
                said = True
                time.sleep(CLOSING_POLL_S)
            else:
                if action == "give up" and self._rank == 0:
                    logger.warning(
                        "FlexDeMo fault tolerance: %s stops waiting for %s after quorum_timeout=%g s; a node that "
                        "finishes its last step after this one left commits it without it and may end on another "
                        "model (its summary says so).",
                        self._identity.name,
                        ", ".join(training),
                        self._config.quorum_timeout,
                    )
                self._closed = True
                return

    def _closing_action(self, deadline: float) -> tuple[str, list[str]]:
        """What a node that finished does next: ``round``, ``wait``, ``done`` or ``give up``; decided on rank 0."""
        decision: list = [("done", [])]
        if self._rank == 0:
            finished = self._finished_nodes
            view = read_lighthouse(self._identity.lighthouse)
            if view.job_step >= self._final_step:  # a round after the job's last step: its nodes have finished
                finished.update(node_of(replica) for replica in view.last_quorum)
            training = sorted({node_of(replica) for replica in view.heartbeating} - finished - {self._identity.name})
            if view.error:
                decision[0] = ("done", [])
            elif view.waiting or (self.behind_at_close and training and time.monotonic() < deadline):
                decision[0] = ("round", training)
            elif not training:
                decision[0] = ("done", [])
            else:
                decision[0] = ("give up" if time.monotonic() > deadline else "wait", training)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        return decision[0]


def ending_note(
    name: str,
    membership: list[tuple[int, tuple[str, ...]]],
    step: int,
    behind_at_close: bool,
    ended_alike: frozenset[str] = frozenset(),
) -> str:
    """A warning when node ``name`` cannot tell that it ended on the same model as every node it trained with
    ("" otherwise).

    ``membership``: the quorums' history (see :attr:`~.membership.Membership.history`); ``step``: the committed
    steps now; ``ended_alike``: more nodes known to hold this node's final model (:attr:`JobEnd.ended_alike`: they
    finished in a round after the job's last step, whose nodes compare checksums), beside those of its last quorum,
    which committed its last round with it. Only the nodes it trained with and cannot vouch for are named: those
    that left, or finished while it was late.
    """
    if behind_at_close:
        return (
            f"FlexDeMo fault tolerance: {name} ended training behind the others: its last round did "
            "not commit and no node that finished was left to catch up from. Take the job's final model from "
            "another node."
        )
    if not membership:
        return ""
    changed_at, last = membership[-1]
    trained_with = sorted({node for _, nodes in membership for node in nodes} - {name})
    unknown = [node for node in trained_with if node not in ended_alike and node not in last]
    if not unknown:
        return ""
    return (
        f"FlexDeMo fault tolerance: {name} cannot tell whether {', '.join(unknown)} ended on its model: they "
        f"trained with it, but did not finish with it (its last quorum, from {changed_at} committed steps on: "
        f"{', '.join(last)}; {step} committed steps here). A node that left, or finished while another was late, "
        "may hold other parameters: take the job's final model from a node whose summary line 'quorum of live "
        "nodes' ends in the largest quorum."
    )
