"""Who is live: the nodes of each quorum this node was in, and what the node says when they change.

torchft's manager keeps only a quorum's size; :class:`QuorumWatch` learns its nodes from the
Lighthouse's answer. :class:`Membership` keeps their history, says one line when they change
(``node0: the quorum shrinks from 2 to 1 live nodes (node1 left; now node0) ...``), and
:func:`membership_story` tells the run summary how the quorum grew and shrank.
"""

from __future__ import annotations

import itertools
import logging
import time

from .lighthouse import node_of

logger = logging.getLogger(__name__)

MAX_STORY_CHANGES = 6
"""Quorum changes the run summary spells out; the rest are counted, and the last is said."""


class QuorumWatch:
    """Records which nodes each quorum holds (torchft's manager keeps only their count).

    It stands in for the manager's private client (``Manager._client``, whose ``_quorum``
    returns the Lighthouse's answer; torchft 0.2.0, checked by tests/test_fault_tolerance_settings.py)
    and passes every call through.
    """

    def __init__(self, manager):
        self._client = manager._client
        self.members: tuple[str, ...] = ()
        """Node names of the latest quorum, sorted (empty before the first)."""
        self.answered_at = 0.0
        """``time.perf_counter()`` when the Lighthouse last answered (the round's process group and heal follow)."""
        manager._client = self

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        self.answered_at = time.perf_counter()
        self.members = tuple(sorted(node_of(replica) for replica in quorum.replica_ids))
        return quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class Membership:
    """The nodes of this node's quorums: the latest, and each change since this process started."""

    def __init__(self, manager, name: str, rank: int):
        self._manager, self._name, self._rank = manager, name, rank
        self._watch = QuorumWatch(manager)
        self.history: list[tuple[int, tuple[str, ...]]] = []
        """``(committed steps, nodes)`` at each change of the quorum's nodes this node saw, oldest first."""
        self.undone = 0
        """Steps undone on this node since the quorum last changed."""

    @property
    def members(self) -> tuple[str, ...]:
        """Node names of the latest quorum, sorted (empty before the first)."""
        return self._watch.members

    @property
    def answered_at(self) -> float:
        """``time.perf_counter()`` when the Lighthouse last answered."""
        return self._watch.answered_at

    def note(self, previous: tuple[str, ...]) -> None:
        """One line when the quorum's nodes changed from ``previous``: who left or joined, and the steps undone
        meanwhile."""
        members = self.members
        if members == previous:
            return
        self.history.append((self._manager.current_step(), members))  # also on the ranks that do not say it
        undone, self.undone = self.undone, 0
        if not previous or self._rank != 0:
            return
        size = "shrinks" if len(members) < len(previous) else "grows" if len(members) > len(previous) else "changes"
        logger.warning(
            "FlexDeMo fault tolerance: %s: the quorum %s from %d to %d live nodes (%s; now %s) at %d committed "
            "steps; %d step(s) undone on this node since the last change.",
            self._name,
            size,
            len(previous),
            len(members),
            quorum_moves(previous, members),
            ", ".join(members),
            self._manager.current_step(),
            undone,
        )


def membership_story(membership: list[tuple[int, tuple[str, ...]]], step: int) -> str:
    """How the quorum grew and shrank (``membership``: :attr:`Membership.history`), in one line; ``step``: the
    committed steps now."""
    if not membership:
        return "no quorum met"
    first_step, nodes = membership[0]
    parts = [f"{len(nodes)} node(s) ({', '.join(nodes)}) after {first_step} committed steps"]
    for (_, before), (changed_at, nodes) in itertools.pairwise(membership):
        size = "grew" if len(nodes) > len(before) else "shrank" if len(nodes) < len(before) else "changed"
        parts.append(f"{size} to {len(nodes)} after {changed_at} ({quorum_moves(before, nodes)})")
    if len(parts) > MAX_STORY_CHANGES + 1:  # a node that is always late comes and goes every few steps
        hidden = len(parts) - MAX_STORY_CHANGES - 1
        parts = [*parts[:MAX_STORY_CHANGES], f"{hidden} more change(s)", parts[-1]]
    return "; ".join(parts) + f"; {step} committed steps in all"


def quorum_moves(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    """Who left and who joined between two quorums, e.g. ``node1 left; node2, node3 joined``."""
    left = [node for node in before if node not in after]
    joined = [node for node in after if node not in before]
    moves = [f"{', '.join(left)} left"] if left else []
    moves += [f"{', '.join(joined)} joined"] if joined else []
    return "; ".join(moves)
