""":class:`ManagedReplicas`: this process's place in the quorum of nodes, the one object the optimizer talks to.

It holds the process's torchft ``Manager`` and its parts, each of which answers one kind of
question: the step's quorum and commit (``quorum``, :mod:`.quorum`), who is live (``members``,
:mod:`.membership`), what a healing node receives (``healing``, :mod:`.healing`), the end of a job
(``end``, :mod:`.closing`), when the node sits out (``sit_out``, :mod:`.sit_out`) and the exchange's
collectives (``group``, :mod:`.collectives`). The optimizer's step goes through the methods here,
which tie the parts together; the Trainer and the run summary ask the parts directly.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config import FlexDeMoConfig
from .closing import JobEnd, ending_note
from .collectives import ManagedTopology, QuorumGroup
from .healing import Healing
from .membership import Membership, membership_story
from .node import NodeIdentity, import_torchft, start_manager
from .quorum import StepQuorum
from .sit_out import SitOut
from .timeline import RoundClock

logger = logging.getLogger(__name__)

QUORUM_WAITS_KEPT = 1000
"""Rounds whose quorum wait the run summary describes (the latest)."""


class ManagedReplicas:
    """This process's membership in the quorum of nodes (one torchft ``Manager``).

    Build one per process, after ``torch.distributed`` is initialised for the node's own
    processes (FSDP2 inside the node); the node's rank 0 talks to the Lighthouse.

    Args:
        config: the optimizer's settings (``min_replicas``, ``ft_timeout``, ``quorum_timeout``).
        identity: the Lighthouse address and this node's index (default: from the environment).
        device: where exchanges run (``cuda`` uses torchft's NCCL group, otherwise gloo).
    """

    def __init__(self, config: FlexDeMoConfig, identity: NodeIdentity | None = None, device=None):
        torchft = import_torchft()
        self.config = config
        self.identity = identity or NodeIdentity.from_env(config.min_replicas)
        self.device = torch.device(device or "cpu")
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._rank = rank
        self.manager, group, self._store = start_manager(torchft, config, self.identity, self.device)
        self._shut_down = False
        self.clock = RoundClock()
        """Seconds this process spent in each phase of its quorum rounds (:mod:`.timeline`)."""
        self.sit_out = SitOut(config, self.identity, rank)
        self._quorum_waits: deque[float] = deque(maxlen=QUORUM_WAITS_KEPT)  # seconds from asking to the answer
        atexit.register(_shut_down_at_exit, weakref.ref(self))
        # The healing node receives the peer's settings first (checked before anything loads), then its round.
        self.healing = Healing(self.manager, self.identity, rank, self.clock)
        self.end = JobEnd(self.manager, self.identity, config, rank, self.device)
        self.members = Membership(self.manager, self.identity.name, rank)
        self.quorum = StepQuorum(self.manager, self.identity, config, rank)
        self.group = QuorumGroup(self.manager, group, self.device, self.clock)
        self.steps_before_quorum = 0
        """The committed steps this node held when it asked for the current quorum (before any heal)."""

    # -- one step --------------------------------------------------------------------------

    def begin(self) -> bool:
        """Join this step's quorum (no-op if open); returns True if this call copied a peer's state."""
        if self.quorum.round_open:
            return False
        self.clock.add("sit_out", self.sit_out.before_asking(self.members.members, self.end.finished))
        self.healing.start_round()
        self.steps_before_quorum = self.manager.current_step()
        previous = self.members.members
        asked = time.perf_counter()
        try:
            self.quorum.join()
        finally:
            self._time_join(asked)
        self.members.note(previous)
        self.end.joined()
        self.quorum.check_job_state()
        return self.healing.say_healed()

    def quorum_wait_story(self) -> str:
        """How long this node waited for its training rounds' quorums, in one line ("" if it met none)."""
        if not self._quorum_waits:
            return ""
        waits = sorted(self._quorum_waits)
        median, p95 = waits[len(waits) // 2], waits[min(len(waits) - 1, int(0.95 * len(waits)))]
        return (
            f"median {median * 1e3:.0f} ms, 95th percentile {p95 * 1e3:.0f} ms over the last {len(waits)} rounds (a "
            "node that waits long is early: the others arrive that much later; a Lighthouse --join_timeout_ms below "
            "the healthy nodes' spread leaves some out when none is slow)"
        )

    def _time_join(self, asked: float) -> None:
        """Split the join's seconds at the Lighthouse's answer: the wait for the quorum, then the group and heal."""
        joined, answered = time.perf_counter(), self.members.answered_at
        answered = answered if asked <= answered <= joined else joined
        self.clock.add("quorum", answered - asked)
        if not self.end.finished:
            self._quorum_waits.append(answered - asked)
        self.clock.add("heal", joined - answered)

    def commit(self, trained: bool = True) -> bool:
        """Every process of the node agrees whether the step stands; False: undo it.

        ``trained``: whether the round trained a step (not a round of ``synchronize()`` or a closing one), for the
        samples it counts."""
        with self.clock.timing("commit"):
            committed = self.quorum.commit(trained)
        self.sit_out.round_done(self.members.members)
        if not committed:
            self.members.undone += 1
        return committed

    @property
    def step(self) -> int:
        """Steps committed by the quorum so far."""
        return self.manager.current_step()

    def topology(self) -> ManagedTopology:
        """The replicas of the current (or, between steps, the last) quorum."""
        if not self.quorum.met:
            return ManagedTopology(group=None, size=1, rank=0, quorum=self.group)
        rank = self.manager.participating_rank()
        return ManagedTopology(group=None, size=self.manager.num_participants(), rank=rank or 0, quorum=self.group)

    def fingerprints_of_leaders(
        self, fingerprint: torch.Tensor, unapplied: int = 0, closing: bool = False
    ) -> list[int]:
        """Parameter checksums of the last quorum's nodes that committed the most steps ([] if it failed).

        A node that missed a commit differs on purpose until its next quorum heals it, and one whose
        parameters still lack ``unapplied`` steps it will replay counts as that far behind. After training
        (:meth:`close`) only a closing round compares: the others no longer join this node's collectives.
        """
        size = self.topology().size
        if size == 1 or (self.end.finished and not closing):
            return [int(fingerprint)]
        return self.group.fingerprints_of_leaders(fingerprint, size, self.step - unapplied)

    # -- the end of training -----------------------------------------------------------------

    def close(self, closing_round: Callable[[], bool]) -> None:
        """At the end of training: stay while a live node is still on its last step, so that it ends on the same model.

        With ``join_quorum='when_ready'`` the job's last step can commit without a late node; were the others to
        leave, it would commit a last step of its own. So a node that finished joins a closing round whenever one
        waits at the Lighthouse: nothing is exchanged, the late node catches up (by replay, or a copy) and finishes
        too, and ``closing_round()`` commits the round. It leaves once every heartbeating node has finished (it was
        in this node's last round, or in a round after the job's last step), or after ``quorum_timeout``.
        """
        if self.quorum.met:
            self.end.close(self.begin, closing_round, self.members.members, self.quorum.uncommitted > 0)

    def ending_note(self) -> str:
        """A warning when this node cannot tell that every node it trained with ended on its model ("" otherwise)."""
        history = self.members.history
        return ending_note(self.identity.name, history, self.step, self.end.behind_at_close, self.end.ended_alike)

    def membership_story(self) -> str:
        """How the quorum grew and shrank while this node was in it, in one line."""
        return membership_story(self.members.history, self.step)

    # -- exit ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop this node's torchft manager and free its process group; runs at exit, while Python is whole.

        Left to the interpreter's teardown, a gloo collective still pending at exit completes on a
        gloo thread that can no longer take the GIL, and a run that went well ends in SIGABRT
        ("terminate called without an active exception"). Freed here, the group waits for such a
        collective instead, ``ft_timeout`` at most; the manager stops after it, so that a peer
        still taking this node's state meanwhile can finish.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self.group.shutdown()
        self.manager.shutdown(wait=False)
        self._store = None


def _shut_down_at_exit(replicas: weakref.ref[ManagedReplicas]) -> None:
    node = replicas()
    if node is not None:
        node.shutdown()


_NODE: ManagedReplicas | None = None


NODE_SETTINGS = (
    "fault_tolerance",
    "min_replicas",
    "ft_timeout",
    "quorum_timeout",
    "join_quorum",
    "stall_wait",
    "replay_steps",
)
"""The settings a node's quorum rounds read (the optimizer's others are each optimizer's own)."""


def node_replicas(config: FlexDeMoConfig, device=None) -> ManagedReplicas:
    """This process's one :class:`ManagedReplicas` (a process belongs to one quorum), built on first use; a later
    call with other node settings (:data:`NODE_SETTINGS`) is refused (the node would keep the first ones without a
    word)."""
    global _NODE
    if _NODE is None:
        _NODE = ManagedReplicas(config, device=device)
        return _NODE
    ours, theirs = dataclasses.asdict(_NODE.config), dataclasses.asdict(config)
    differ = ", ".join(f"{k}={theirs[k]!r} (the node has {ours[k]!r})" for k in NODE_SETTINGS if ours[k] != theirs[k])
    if differ:
        raise ValueError(
            f"FlexDeMo: this process already belongs to a torchft node, started with other settings: {differ}. A "
            "process is one node: give every optimizer of it the same settings."
        )
    return _NODE
