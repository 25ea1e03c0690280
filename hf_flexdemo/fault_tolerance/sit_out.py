"""Sitting out: a node stays out of the quorum while the others would only wait for it.

Two kinds of node make the others wait. One that **stalled** (its processes did not run, see
:mod:`.stalls`) tends to stall again, and a stall inside a round holds every member in the
collective: it sits out until it has run ``stall_wait`` seconds without one. One that is
**slower** than the others in compute is waited for at every quorum after one it was in: the
Lighthouse waits up to its ``--join_timeout_ms`` for a member of the last quorum, so a node slower
by less than that drags the others to its pace; slower by more, it costs them that long each time
it was in their last quorum. While its node computes, rank 0 reads the Lighthouse's status page
every :data:`POLL_S` and adds up the time in which every other node of its last quorum waited
for a quorum: at its own request it knows how long they waited. Once they lost more than
:data:`DRAG_SHARE` of their time to it over :data:`DRAG_ROUNDS` rounds, it sits out and tries
again. It sits out for about three quarters of the steps it can catch up by replay
(``replay_steps`` at the others' pace, :data:`DRAG_SIT_OUT_S` at most), not longer: a copy of the
whole state on each return would cost a slow link more than the wait it saves.

A node sits out only where the others can form a quorum without it: torchft's Lighthouse needs
more than half of the heartbeating nodes (so not with two nodes), and ``min_replicas``. And a
slower one only while the others go on without it (they committed steps while it computed) or
all wait for it at that moment, so that two nodes late together do not both sit out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..config import FlexDeMoConfig
from .lighthouse import read_lighthouse
from .node import NodeIdentity
from .stalls import StallWatch

logger = logging.getLogger(__name__)

DRAG_SHARE = 0.15
"""The share of their time the others may spend waiting for a node before it sits out (they keep 85%)."""
DRAG_ROUNDS = 4
"""Rounds over which that share is measured."""
DRAG_SIT_OUT_S = 30.0
"""The longest a node the others keep waiting for sits out before it tries again."""
REPLAY_SHARE = 0.75
"""The share of its replay horizon (``replay_steps`` at the others' pace) such a node sits out."""
POLL_S = 0.05
"""How often rank 0 reads the Lighthouse's status page while its node computes after a round."""


def others_can_go_on(members: tuple[str, ...], min_replicas: int) -> bool:
    """Whether the other nodes of the last quorum (``members``) form a quorum without this one."""
    others = len(members) - 1
    return others > len(members) / 2 and others >= min_replicas


class SitOut:
    """Decides, before each request for a quorum, whether this node sits out, and for how long."""

    def __init__(self, config: FlexDeMoConfig, identity: NodeIdentity, rank: int):
        self._config, self._identity, self._rank = config, identity, rank
        self._stalls = StallWatch().start() if config.stall_wait > 0 else None
        self._measure_drag = config.stall_wait > 0 and config.join_quorum == "when_ready" and rank == 0
        self._rounds: deque[tuple[float, float]] = deque(maxlen=DRAG_ROUNDS)  # (others waited, this node's interval)
        self._round_done: float | None = None  # when this node's last round ended
        self._others = 0  # the other nodes of its last quorum
        self._lock = threading.Lock()
        self._others_waited = 0.0  # since its last round: seconds in which all of them waited for a quorum
        self._waiting_since: float | None = None  # the start of the current such stretch
        self._job_steps: list[tuple[float, int]] = []  # since its last round: the first and last (time, job step) seen
        self._paces: deque[float] = deque(maxlen=DRAG_ROUNDS)  # the others' seconds per step, as seen while computing
        self._others_went_on = False  # whether they committed steps without this node while it computed
        self._measuring = threading.Event()
        self.after_stalls: list[float] = []
        """Seconds of each sit-out after a stall."""
        self.while_slower: list[float] = []
        """Seconds of each sit-out because the others kept waiting for this node."""
        if self._measure_drag:
            threading.Thread(target=self._watch_lighthouse, name="flexdemo-drag-watch", daemon=True).start()

    # -- measuring how long the others wait ------------------------------------------------

    def round_done(self, members: tuple[str, ...]) -> None:
        """This node's round ended (committed or not): watch for the others' next request while it computes."""
        with self._lock:
            self._round_done, self._others = time.monotonic(), len(members) - 1
            self._others_waited, self._waiting_since, self._job_steps = 0.0, None, []
        if self._measure_drag and self._others > 0:
            self._measuring.set()

    def _watch_lighthouse(self) -> None:
        while True:
            self._measuring.wait()
            view = read_lighthouse(self._identity.lighthouse, timeout=1.0)
            with self._lock:
                if self._measuring.is_set() and not view.error:
                    now = time.monotonic()
                    self._count_waiting(view.waiting >= self._others, now)
                    self._job_steps[1:] = [(now, view.job_step)]  # the first look stays
            time.sleep(POLL_S)

    def _count_waiting(self, all_waiting: bool, now: float) -> None:
        """One look at the Lighthouse: whether every other node waited for a quorum at ``now``."""
        if all_waiting and self._waiting_since is None:
            self._waiting_since = now
        elif not all_waiting and self._waiting_since is not None:  # they formed a quorum (without this node)
            self._others_waited += now - self._waiting_since
            self._waiting_since = None

    def note_round(self, others_waited: float, interval: float) -> None:
        """One round: the others waited ``others_waited`` s of this node's ``interval`` s since its last round."""
        self._rounds.append((others_waited, interval))

    def dragging(self) -> bool:
        """Whether the others lost more than :data:`DRAG_SHARE` of their time to this node over the last rounds."""
        if len(self._rounds) < DRAG_ROUNDS:
            return False
        waited, interval = (sum(values) for values in zip(*self._rounds))
        return waited > DRAG_SHARE * interval

    # -- before asking for a quorum ----------------------------------------------------------

    def before_asking(self, members: tuple[str, ...], finished: bool) -> float:
        """Sit out if this node stalled lately or the others keep waiting for it; returns the seconds sat out."""
        now = time.monotonic()
        self._measuring.clear()
        with self._lock:
            if self._round_done is not None and self._measure_drag and self._others > 0:
                self._count_waiting(False, now)  # a stretch still going on ends with this request
                self.note_round(self._others_waited, now - self._round_done)
                self._others_went_on = len(self._job_steps) == 2 and self._job_steps[1][1] > self._job_steps[0][1]
                if self._others_went_on:
                    (t0, s0), (t1, s1) = self._job_steps
                    self._paces.append((t1 - t0) / (s1 - s0))
            self._round_done = None
        if finished or not others_can_go_on(members, self._config.min_replicas):
            return 0.0
        watch = self._stalls
        if watch is not None and watch.steady_for() < self._config.stall_wait:
            return self._after_stall(watch)
        if self.dragging() and (self._others_went_on or self._all_others_wait(members)):
            return self._while_slower()
        return 0.0

    def _all_others_wait(self, members: tuple[str, ...]) -> bool:
        """Whether every other node of the last quorum waits for a quorum right now: then it waits for this one.

        With the others going on without it (they committed steps while it computed), or all waiting for it, a
        node may sit out; two nodes that are both late (and would leave too few to form a quorum) see neither."""
        view = read_lighthouse(self._identity.lighthouse, timeout=1.0)
        return not view.error and view.waiting >= len(members) - 1

    def _after_stall(self, watch: StallWatch) -> float:
        if not self.after_stalls and self._rank == 0:
            logger.warning(
                "FlexDeMo fault tolerance: %s stalled for %.1f s (its processes did not run); it sits out until it has "
                "run stall_wait=%g s without a stall, so that the others do not wait for it inside a round, then "
                "catches up. Later sit-outs are counted in the run summary.",
                self._identity.name,
                watch.stalls[-1],
                self._config.stall_wait,
            )
        waited = watch.wait_until_steady(self._config.stall_wait)
        self.after_stalls.append(waited)
        return waited

    def sit_out_seconds(self) -> float:
        """How long to sit out while slower: most of the replay horizon at the others' pace, :data:`DRAG_SIT_OUT_S` at
        most (and without replay). Their pace: the job's committed steps seen at the Lighthouse while this node
        computed, or else (each of its rounds one step of theirs) its interval less their wait."""
        if not self._config.replay_steps:
            return DRAG_SIT_OUT_S
        if self._paces:
            step = sorted(self._paces)[len(self._paces) // 2]
        else:
            waited, interval = (sum(values) / len(self._rounds) for values in zip(*self._rounds))
            step = max(interval - waited, 0.0)
        return min(DRAG_SIT_OUT_S, REPLAY_SHARE * self._config.replay_steps * step)

    def _while_slower(self) -> float:
        waited, interval = (sum(values) for values in zip(*self._rounds))
        seconds = self.sit_out_seconds()
        if not self.while_slower:
            logger.warning(
                "FlexDeMo fault tolerance: %s: the other nodes spent %.0f%% of their time waiting for it over its last "
                "%d rounds (it computes slower than they do); it sits out %.1f s (most of what replay_steps=%d lets it "
                "catch up by replay) so that they train at their own pace, then tries again. Later sit-outs are "
                "counted in the run summary.",
                self._identity.name,
                100 * waited / interval,
                DRAG_ROUNDS,
                seconds,
                self._config.replay_steps,
            )
        self._rounds.clear()
        time.sleep(seconds)
        self.while_slower.append(seconds)
        return seconds

    def story(self) -> str:
        """This node's sit-outs, in one line ("" if none)."""
        parts = []
        if self.after_stalls:
            parts.append(
                f"{len(self.after_stalls)} after stalls, {sum(self.after_stalls):.1f} s in all (the longest stall: "
                f"{max(self._stalls.stalls):.1f} s)"
            )
        if self.while_slower:
            parts.append(
                f"{len(self.while_slower)} because the others waited for it, {sum(self.while_slower):.1f} s in all"
            )
        return "; ".join(parts)
