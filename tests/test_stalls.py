"""A node tells a stall of its processes from a busy process, sits out after one, and times its quorum rounds."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hf_flexdemo.fault_tolerance.stalls import STALL_S, TICK_S, StallWatch
from hf_flexdemo.fault_tolerance.timeline import PHASES, RoundClock

pytestmark = pytest.mark.unit


class FakeClocks:
    """The wall clock and the process's CPU time, moved by hand."""

    def __init__(self):
        self.wall, self.cpu = 100.0, 10.0

    def advance(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


def test_a_gap_off_the_cpu_is_a_stall_and_a_busy_gap_is_not():
    clocks = FakeClocks()
    watch = StallWatch(clock=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    clocks.advance(TICK_S + 0.01, 0.01)  # a tick on time
    watch.observe()
    clocks.advance(TICK_S + 2.0, 2.0)  # the GIL held for 2 s by a busy thread (pickling a checkpoint): it ran
    watch.observe()
    clocks.advance(TICK_S + STALL_S / 2, 0.0)  # a short hiccup of the scheduler
    watch.observe()
    assert watch.stalls == [] and watch.steady_for() == float("inf")
    clocks.advance(TICK_S + 2.0, 0.001)  # stopped for 2 s: nothing of the process ran
    watch.observe()
    assert watch.stalls == [pytest.approx(2.0)]
    clocks.advance(3.0, 3.0)
    assert watch.steady_for() == pytest.approx(3.0)


def test_waiting_until_steady_returns_at_once_without_a_stall_and_after_the_wait_with_one():
    watch = StallWatch().start()
    assert watch.wait_until_steady(5.0) < 0.05
    watch.last_stall_end = time.monotonic()  # as if a stall had just ended
    waited = watch.wait_until_steady(0.3)
    assert 0.25 <= waited < 1.0, waited


def test_a_process_really_stopped_sees_its_stall():
    """SIGSTOP for 1.5 s, as a stalled machine: the process's own watch reports it once it runs again."""
    code = textwrap.dedent(
        """
        import sys, time
        from hf_flexdemo.fault_tolerance.stalls import StallWatch
        watch = StallWatch().start()
        print("ready", flush=True)
        sys.stdin.readline()
        time.sleep(0.2)
        print(watch.stalls, flush=True)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        child.send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
    stalls = eval(out.strip())  # a list of floats, printed by the child
    assert len(stalls) == 1 and 1.3 <= stalls[0] <= 2.5, out


def test_the_round_clock_adds_each_phase_across_threads():
    clock = RoundClock()
    with clock.timing("exchange"):
        time.sleep(0.05)
    clock.add("quorum", 0.5)
    clock.add("quorum", 0.25)
    totals = clock.totals()
    assert set(totals) == set(PHASES)
    assert totals["quorum"] == 0.75 and 0.04 <= totals["exchange"] < 1.0 and totals["serve"] == 0.0
    with pytest.raises(AssertionError):
        clock.add("forward", 1.0)
