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


def test_a_node_sits_out_only_where_the_others_form_a_quorum_without_it():
    from hf_flexdemo.fault_tolerance.sit_out import others_can_go_on

    assert not others_can_go_on(("node0", "node1"), min_replicas=1)  # 1 of 2 heartbeating is no majority
    assert others_can_go_on(("node0", "node1", "node2"), min_replicas=1)
    assert not others_can_go_on(("node0", "node1", "node2"), min_replicas=3)


def sit_out(monkeypatch):
    from hf_flexdemo.config import FlexDeMoConfig
    from hf_flexdemo.fault_tolerance import NodeIdentity, sit_out

    monkeypatch.setattr(sit_out, "DRAG_SIT_OUT_S", 0.01)
    config = FlexDeMoConfig(fault_tolerance="torchft", join_quorum="when_ready")
    return sit_out.SitOut(config, NodeIdentity("http://127.0.0.1:1", 2, 3), rank=0)


def test_a_node_the_others_keep_waiting_for_sits_out_and_says_so(monkeypatch, caplog):
    from hf_flexdemo.fault_tolerance.sit_out import DRAG_ROUNDS

    node = sit_out(monkeypatch)
    three = ("node0", "node1", "node2")
    for _ in range(DRAG_ROUNDS):  # the others wait 0.1 s of each 1 s: 10%, they keep their pace
        node.note_round(0.1, 1.0)
    assert not node.dragging() and node.before_asking(three, finished=False) == 0.0
    for _ in range(DRAG_ROUNDS):  # 0.4 s of each 1.3 s: they run at this node's pace
        node.note_round(0.4, 1.3)
    assert node.dragging()
    assert node.before_asking(("node0", "node2"), finished=False) == 0.0  # alone, node0 could not go on
    assert node.before_asking(three, finished=True) == 0.0  # a finished node's closing rounds are short
    monkeypatch.setattr(node, "_all_others_wait", lambda members: False)  # one of them sits out, or is late too
    assert node.before_asking(three, finished=False) == 0.0
    monkeypatch.setattr(node, "_all_others_wait", lambda members: True)  # both wait for this node
    assert node.before_asking(three, finished=False) > 0.0
    assert "node2: the other nodes spent 31% of their time waiting for it" in caplog.text
    assert not node.dragging()  # measured afresh after the sit-out
    assert node.story() == "1 because the others waited for it, 0.0 s in all"


def test_a_node_sits_out_most_of_its_replay_horizon_at_the_others_pace(monkeypatch):
    from hf_flexdemo.fault_tolerance import sit_out as module

    node = sit_out(monkeypatch)  # replay_steps=32 (the default)
    monkeypatch.setattr(module, "DRAG_SIT_OUT_S", 30.0)
    for _ in range(module.DRAG_ROUNDS):
        node.note_round(0.4, 1.3)  # the others' step: 1.3 - 0.4 = 0.9 s
    assert node.sit_out_seconds() == pytest.approx(0.75 * 32 * 0.9)
    node._paces.append(0.15)  # the job's steps seen at the Lighthouse: they commit one every 0.15 s
    assert node.sit_out_seconds() == pytest.approx(0.75 * 32 * 0.15)
    node._config.replay_steps = 1000
    assert node.sit_out_seconds() == module.DRAG_SIT_OUT_S  # but never longer than that
    node._config.replay_steps = 0  # every catch-up is a copy anyway
    assert node.sit_out_seconds() == module.DRAG_SIT_OUT_S


def test_the_others_waiting_time_adds_up_their_stretches_at_the_lighthouse(monkeypatch):
    node = sit_out(monkeypatch)
    node.round_done(("node0", "node1", "node2"))
    node._measuring.clear()  # fed by hand below, not by the Lighthouse
    start = node._round_done
    for offset, waiting in [(0.2, True), (0.7, False), (0.9, False), (1.0, True)]:
        node._count_waiting(waiting, start + offset)  # 0.2-0.7: they waited, then formed a quorum alone
    node._count_waiting(False, start + 1.3)  # this node asks at 1.3: they had waited since 1.0
    assert node._others_waited == pytest.approx(0.8)
    node._job_steps = [(start + 0.1, 40), (start + 1.2, 44)]  # the first and last looks: 4 steps in 1.1 s
    node._round_done = start
    node._measure_drag = True
    node.before_asking(("node0", "node1"), finished=False)
    assert node._paces[-1] == pytest.approx(1.1 / 4)
