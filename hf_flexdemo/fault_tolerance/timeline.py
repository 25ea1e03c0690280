"""Where a node's seconds go in its quorum rounds, so that an operator can see what a slow node costs the others.

:class:`RoundClock` adds up, per phase, the seconds this process spends in the quorum's work:

- ``quorum``: waiting for the Lighthouse to form the step's quorum;
- ``heal``: after the answer, until the round is joined: torchft configures the quorum's process
  group and a node that is behind takes a peer's state (the bytes of a catch-up, or a copy);
- ``exchange``: in the quorum's collectives (waiting for the slowest member included);
- ``commit``: the vote that ends the round (every member must vote);
- ``catch_up``: replaying the steps this node missed;
- ``serve``: building the state a healing peer takes from this node (on torchft's thread; the
  transfer itself runs on torchft's HTTP server, beside training);
- ``sit_out``: waiting, after a stall of this node's processes, until they run steadily again
  (:mod:`.stalls`).

The Trainer callback logs them per step as ``flexdemo/seconds_<phase>``; the straggler benchmark
draws them as a timeline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("quorum", "heal", "exchange", "commit", "catch_up", "serve", "sit_out")


class RoundClock:
    """Cumulative seconds per phase since this process started (thread-safe: peers are served on another thread)."""

    def __init__(self):
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        assert phase in self._seconds, phase
        with self._lock:
            self._seconds[phase] += max(seconds, 0.0)

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Adds the seconds spent inside the ``with`` block to ``phase``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def totals(self) -> dict[str, float]:
        """Cumulative seconds per phase, a copy."""
        with self._lock:
            return dict(self._seconds)
