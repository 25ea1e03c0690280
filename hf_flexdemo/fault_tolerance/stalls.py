"""Stalls: stretches in which this node's processes did not run at all (stopped, a paused VM, a swapping machine).

A node in a quorum round holds every other node of the round until it has sent its payload and voted.
If its processes stop running meanwhile, the others wait in the collective for as long as the stall
lasts. This module only sees the stalls; when a node sits out after one is :mod:`.sit_out`'s rule.

:class:`StallWatch` tells a stall from a busy process: a thread ticks every :data:`TICK_S`; a
gap of :data:`STALL_S` between ticks while the process used almost no CPU means nothing of it ran.
A thread holding the GIL (pickling a checkpoint) keeps the process on the CPU, so it is no stall.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

TICK_S = 0.05
"""How often the watch thread looks at the clock."""
STALL_S = 0.5
"""A gap between ticks this long, with the process (nearly) off the CPU, is a stall."""
RUN_SHARE = 0.1
"""Below this share of the gap on the CPU, the process did not run."""


class StallWatch:
    """Watches this process for stalls from a daemon thread; :meth:`wait_until_steady` waits out the time after one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.process_time):
        self._clock, self._cpu = clock, cpu
        self.last_stall_end = -math.inf
        """``clock()`` when the last stall ended."""
        self.stalls: list[float] = []
        """The length of every stall seen, in seconds."""
        self._tick = (clock(), cpu())
        self._lock = threading.Lock()  # the watch thread and a waiting caller both observe

    def start(self) -> StallWatch:
        threading.Thread(target=self._watch, name="flexdemo-stall-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            time.sleep(TICK_S)
            self.observe()

    def observe(self) -> None:
        """One tick: a stall if the wall clock moved :data:`STALL_S` beyond a tick while the CPU time hardly did."""
        with self._lock:
            now, cpu = self._clock(), self._cpu()
            (then, cpu_then), self._tick = self._tick, (now, cpu)
            gap = now - then - TICK_S
            if gap >= STALL_S and cpu - cpu_then < RUN_SHARE * gap:
                self.stalls.append(gap)
                self.last_stall_end = now

    def steady_for(self) -> float:
        """Seconds since the last stall ended (infinite if none), a stall that ends now included."""
        self.observe()
        return self._clock() - self.last_stall_end

    def wait_until_steady(self, steady_s: float, poll_s: float = TICK_S) -> float:
        """Block until this process has run ``steady_s`` seconds without a stall; returns the seconds waited."""
        started = self._clock()
        while steady_s > 0 and self.steady_for() < steady_s:
            time.sleep(min(poll_s, steady_s - self.steady_for()))
        return self._clock() - started
