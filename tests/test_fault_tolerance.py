"""Live fault tolerance on torchft: real Lighthouse, one `accelerate launch` per node, real SIGKILLs.

Each node is its own job (tests/workers/ft_worker.py: the stock Trainer with
``optim_args=...,fault_tolerance=torchft``) and the nodes meet through a
``torchft_lighthouse`` started as its users start it. A lost node is its whole process
group SIGKILLed (launcher and workers), as when a machine disappears.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.ft_nodes import Lighthouse, Node, free_port, wait_until
from support.launch import child_env

from hf_flexdemo import FlexDeMo
from hf_flexdemo.fault_tolerance.rounds import QuorumRounds, wrap_optimizer
from hf_flexdemo.fault_tolerance.timeline import PHASES, RoundClock
from hf_flexdemo.integrations.checkpoints import MARKER
from hf_flexdemo.scheme_traits import SCHEME_SETTINGS, traits_of
from hf_flexdemo.topology import ReplicaTopology, parameter_fingerprint


def ft(opt) -> QuorumRounds:
    """The fault-tolerance wrapper around ``opt``, or one built alone (it serves and takes state as a peer)."""
    return opt.wrapped_by or QuorumRounds(opt)


pytest.importorskip("torchft", reason="torchft is part of the test install (setup.cfg [test])")

TINY = (
    "--per_device_train_batch_size 4 --learning_rate 1e-3 --weight_decay 0.01 --logging_steps 5 --report_to none "
    "--seed 7 --save_strategy no --optim flexdemo"
).split()
"""Weight decay on: under a quorum it waits for the commit and any catch-up (the rules' pass applies it)."""
ALL_SCHEMES = ("demo", "random", "striding", "full", "diloco", "sparseloco")
UPDATE_RULES = {
    "demo_ortho_adam": dict(update="orthogonal"),
    "demo_adam": dict(update="adam"),
}
"""Update rules on demo's wire (hf_flexdemo.updates): adam keeps shared state that healing copies."""
"""Every scheme that exchanges."""


FT_TIMEOUT_S = 10  # a collective with a lost node fails after this long at most
LOST_NODE_STEPS = 100
LATE_NODE_WAIT = ("--slow_step_s", "3")
"""With --slow_while: the others' steps take 3 s while a late node starts, 100 s and more for it to start in."""


def ft_args(extra: str = "", timeout: float = FT_TIMEOUT_S, quorum_timeout: float = 60, topk: int = 8) -> list[str]:
    """The torchft settings, with a small top-k on the schemes that pick one (the others refuse topk and chunk)."""
    scheme = re.search(r"scheme=(\w+)", extra)
    tiles = f"topk={topk},chunk=16," if "topk" in traits_of(scheme[1] if scheme else "demo").reads else ""
    return [
        "--optim_args",
        f"{tiles}fault_tolerance=torchft,ft_timeout={timeout},quorum_timeout={quorum_timeout}{extra}",
    ]


@pytest.fixture
def lighthouse(tmp_path):
    house = Lighthouse(tmp_path / "lighthouse.log")
    yield house
    house.stop()


@pytest.fixture
def patient_lighthouse(tmp_path):
    """For three nodes, two of them slowed (LATE_NODE_WAIT) while the third arrives at any moment of their step.

    Two of three form a quorum, so with the 2 s join timeout a slowed node would be left out of the
    newcomer's first quorums and heal; waiting longer than a slowed step keeps the two together.
    """
    house = Lighthouse(tmp_path / "lighthouse.log", join_timeout_ms=10_000)
    yield house
    house.stop()


def nodes_of(count: int, lighthouse: Lighthouse, out, *flags: str, processes: int = 2, extra=None) -> list[Node]:
    launch = ("--num_processes", str(processes))
    return [
        Node(
            i,
            count,
            lighthouse.address,
            out,
            *flags,
            *(extra or {}).get(i, ()),
            config="cpu_ft_node.yaml",
            launch=launch,
        )
        for i in range(count)
    ]


def finish(nodes: list[Node], timeout: float = 300) -> None:
    for node in nodes:
        code = node.wait(timeout)
        assert code == 0, f"node{node.index} exited with {code}:\n{node.log()[-6000:]}"


def losses_fell(result: dict) -> bool:
    values = [loss for _, loss in result["losses"]]
    return values[-1] < values[0]


# -- a lost node, and its return --------------------------------------------------------------


LOST_NODE_SCHEMES = ("demo", "diloco")
"""One scheme for each collective on the wire: demo all-gathers every step, diloco all-reduces every inner_steps.
What each scheme undoes, heals and replays is unit-tested below for all of them; sparseloco and random are
killed mid-exchange (KILLED_MID_EXCHANGE), so each of the four keeps a launch with a real SIGKILL."""


@pytest.mark.faults
@pytest.mark.parametrize("scheme", LOST_NODE_SCHEMES)
def test_a_lost_node_never_stops_the_others_and_rejoins(lighthouse, tmp_path, scheme):
    extra = ",inner_steps=4" if scheme == "diloco" else ""
    slow = tmp_path / "slow_while_node1_is_away"
    # 1 s steps while node1 is away (more would delay the survivor's first step after the loss, timed below):
    # about 90 s for its relaunch to come back; the steps after its return are as quick as they come.
    flags = [*TINY, "--max_steps", str(LOST_NODE_STEPS), "--step_delay", "0.05", *ft_args(f",scheme={scheme}{extra}")]
    nodes = nodes_of(2, lighthouse, tmp_path, *flags, extra={0: ("--slow_while", str(slow))})
    for node in nodes:
        node.start()
    # Both must have committed a step together: a node that started late (load) may not hold the job's state yet.
    wait_until(lambda: nodes[1].step() >= 8 and committed_together(nodes), 180, "both nodes to train", running=nodes)
    slow.touch()  # the survivor still trains when the relaunch returns
    killed_at = nodes[1].kill()
    # Relaunch once the survivor trains alone: on an idle machine a relaunch can rejoin before it shrinks.
    shrunk = lambda: any(p["replicas"] == 1 for p in nodes[0].progress() if p["time"] > killed_at)  # noqa: E731
    wait_until(shrunk, 120, "the quorum to shrink to the live node", running=nodes[:1])
    step_at_relaunch = nodes[0].step()
    relaunched = time.time()
    nodes[1].start()

    # Meanwhile the survivor trains on alone, without a restart.
    wait_until(lambda: nodes[0].step() >= step_at_relaunch + 4, 120, "the survivor to keep stepping", running=nodes)
    after = [p for p in nodes[0].progress() if p["time"] > killed_at][:4]
    # Bounded by failure detection (a collective's ft_timeout, the Lighthouse's heartbeat timeout), not by a restart.
    detection = FT_TIMEOUT_S + lighthouse.heartbeat_timeout_s
    assert after[0]["time"] - killed_at < detection, f"the survivor's next step came over {detection} s after the loss"
    back = lambda: any(p["time"] > relaunched for p in nodes[1].progress())  # noqa: E731
    wait_until(back, 120, "node1 to train again", running=nodes)
    slow.unlink()
    finish(nodes)
    rejoined = nodes[1].progress()
    rejoined = rejoined[next(i for i, p in enumerate(rejoined) if p["time"] > relaunched) :]
    assert rejoined[0]["step"] > step_at_relaunch, "the relaunched node started over instead of taking the live state"
    assert rejoined[0]["replicas"] == 2
    for rank in (0, 1):
        survivor, returned = nodes[0].result(rank), nodes[1].result(rank)
        assert survivor["fingerprint"] == returned["fingerprint"], f"rank {rank}: nodes end with different parameters"
        assert survivor["global_step"] == returned["global_step"] == LOST_NODE_STEPS
        assert returned["epoch"] == pytest.approx(survivor["epoch"], abs=1e-9), "the healed node kept its own epoch"
        assert losses_fell(survivor)
        assert returned["losses"][-1][1] < survivor["losses"][0][1]  # it trains on from the live state
    assert "took the parameters and training position from a live peer" in nodes[1].log()
    said_by_us(nodes, killed=1)
    if scheme == "demo":
        a_finished_job_is_not_started_over(nodes[1])


REPLAY_STEPS = 30


@pytest.mark.faults
def test_a_paused_node_catches_up_by_replay_and_copies_the_state_only_when_further_behind(lighthouse, tmp_path):
    """Node 1 is frozen (SIGSTOP) while node 0 commits steps alone, twice. A few steps behind, it replays their
    payloads; more than replay_steps behind, it copies the whole state. Both nodes end bitwise equal.

    First, node 0's rank 0 comes to one vote ft_timeout + 1 s after its sibling (as when its exchange waits out
    ft_timeout while the sibling's succeeds): the sibling waits for it, and the step commits."""
    slow = tmp_path / "slow_while_node1_returns"  # node 0 waits for node 1's return, so it misses few steps more
    late = tmp_path / "node0_rank0_votes_late"
    flags = [*TINY, "--max_steps", "150", "--step_delay", "0.1", *ft_args(f",replay_steps={REPLAY_STEPS}", timeout=5)]
    node0 = ("--slow_while", str(slow), "--late_vote_when", str(late))
    nodes = nodes_of(2, lighthouse, tmp_path, *flags, extra={0: node0})
    for node in nodes:
        node.start()
    wait_until(lambda: committed_together(nodes), 180, "both nodes to train", running=nodes)

    touched = time.time()
    late.touch()
    wait_until(lambda: not late.exists(), 60, "node 0's rank 0 to vote late", running=nodes)
    waited = lambda: [  # noqa: E731  (rank 1's steps that waited out its sibling's vote and committed)
        (a, b) for a, b in itertools.pairwise(nodes[0].progress(rank=1))
        if b["time"] > touched and b["time"] - a["time"] > 5 and b["committed"] == a["committed"] + 1
    ]  # fmt: skip
    wait_until(waited, 60, "node 0 to commit the step its rank 0 voted late in", running=nodes)

    def frozen_while_node0_commits(steps: int) -> None:
        paused = time.time()
        nodes[1].pause()
        alone = lambda: sum(p["replicas"] == 1 and p["time"] > paused for p in nodes[0].progress()) >= steps  # noqa: E731
        wait_until(alone, 120, f"node 0 to commit {steps} steps alone", running=nodes[:1])
        slow.touch()
        resumed, ahead = time.time(), nodes[0].progress()[-1]["committed"]
        nodes[1].resume()
        # Its first step back fails (its exchange had timed out); then it heals and commits past node 0's count.
        back = lambda: any(p["time"] > resumed and p["committed"] > ahead for p in nodes[1].progress())  # noqa: E731
        wait_until(back, 120, "node 1 to commit with node 0 again", running=nodes)
        slow.unlink()

    copied = "took the parameters and training position from a live peer"
    copies = nodes[1].log().count(copied)  # a node that starts after the first steps copies the state once
    frozen_while_node0_commits(2)
    log = nodes[1].log()
    caught_up = re.findall(r"node1 missed (\d+) committed step\(s\) and catches up by replaying", log)
    assert caught_up and int(caught_up[0]) <= REPLAY_STEPS, log[-6000:]
    assert log.count(copied) == copies, log[-6000:]
    # A few steps' payloads, not the state (a tenth of it at DeMo's real compression: BENCHMARKS.md; this tiny
    # model's 16 x 16 tiles keep 8 of 256 coefficients, each payload about a 25th of the parameters).
    moved = re.search(r"replaying their exchanged payloads \(([\d.]+) MB .*would move ([\d.]+) MB\)", log)
    assert float(moved[1]) < float(moved[2]), moved[0]

    # Frozen, it stalled; but with two nodes node 0 cannot form a quorum without it, so it does not sit out.
    assert "sits out" not in log, log[-6000:]
    frozen_while_node0_commits(REPLAY_STEPS + 10)
    assert nodes[1].log().count(copied) == copies + 1, nodes[1].log()[-6000:]
    finish(nodes)
    for rank in (0, 1):
        first, second = nodes[0].result(rank), nodes[1].result(rank)
        assert first["fingerprint"] == second["fingerprint"], f"rank {rank}: the nodes end with different parameters"
        assert first["global_step"] == second["global_step"] == 150


@pytest.mark.faults
def test_a_slow_node_that_joins_when_ready_is_left_out_catches_up_and_contributes_again_when_fast(tmp_path):
    """join_quorum=when_ready, three 1-process nodes: node 2 takes 3 s a step, the others a tenth of that. They do
    not wait for it (the Lighthouse waits 0.5 s for a late member, and two of three heartbeating nodes are a
    majority); node 2 is left out of the steps it is late for, catches up by replay and commits with them when it
    is in time. Once fast again it trains with them every step. Held at a step near the end, it is late for the
    job's last step: the others say they stay for it; released, it catches up, and all three end bitwise equal."""
    house = Lighthouse(tmp_path / "lighthouse.log", join_timeout_ms=500)
    slow, held = tmp_path / "node2_is_slow", tmp_path / "node2_is_held"
    slow.touch()
    extra = f",join_quorum=when_ready,replay_steps={REPLAY_STEPS}"
    flags = [*TINY, "--max_steps", "200", "--step_delay", "0.1", *ft_args(extra)]
    slowed = ("--slow_while", str(slow), "--slow_step_s", "3", "--hold_while", str(held))
    nodes = nodes_of(3, house, tmp_path, *flags, processes=1, extra={2: slowed})
    try:
        for node in nodes:
            node.start()

        def jumps() -> int:  # node 2's commits that took it more than one step forward: catch-ups
            lines = nodes[2].progress()
            return sum(b["committed"] - a["committed"] > 1 for a, b in itertools.pairwise(lines))

        wait_until(lambda: jumps() >= 2, 240, "node 2 to catch up twice", running=nodes)
        assert sum(p["replicas"] == 2 for p in nodes[0].progress()) >= 10, "the fast nodes waited for the slow one"
        assert any(p["replicas"] == 3 for p in nodes[2].progress()), "the slow node never committed with the others"
        slow.unlink()
        recovered = len(nodes[2].progress())
        fast_again = lambda: sum(p["replicas"] == 3 for p in nodes[2].progress()[recovered:]) >= 10  # noqa: E731
        wait_until(fast_again, 120, "node 2 to train with the others at their pace", running=nodes)
        # Late for the last step, whenever its steps end: held until the others finished and stay for it.
        # Held from step 180 on (of 200), it is fewer than replay_steps behind when released.
        wait_until(lambda: nodes[0].step() >= 180, 120, "the others to near their last step", running=nodes)
        held.touch()
        stays = "finished training and stays for node2, still on its last step"
        wait_until(lambda: all(stays in node.log() for node in nodes[:2]), 120, "the others to stay", running=nodes)
        held.unlink()
        finish(nodes)
    finally:
        house.stop()
    log = nodes[2].log()
    assert re.search(r"node2 missed \d+ committed step\(s\) and catches up by replaying", log), log[-6000:]
    assert log.count("catches up by replaying") == 1  # said once; the rest in the summary
    assert re.search(r"behind and caught up: \d+ catch-up\(s\) by replay", log), log[-3000:]
    assert not any("cannot tell whether" in node.log() for node in nodes)  # every node knows they ended alike
    results = [node.result(0) for node in nodes]
    assert len({r["fingerprint"] for r in results}) == 1, "the nodes end with different parameters"
    assert all(r["global_step"] == 200 for r in results)
    # Each logged step says where the node's seconds went in its rounds: the fast nodes waited for quorums and
    # exchanged every step, and served node 2's catch-ups.
    seconds = results[0]["round_seconds"]
    assert seconds and all(set(logged) == set(PHASES) for logged in seconds), seconds[:2]
    assert all(sum(logged[phase] for logged in seconds) > 0 for phase in ("quorum", "exchange", "commit", "serve"))


@pytest.mark.faults
def test_a_node_started_mid_run_heals_once_reads_its_own_data_and_the_job_grows(patient_lighthouse, tmp_path):
    """NUM_REPLICA_GROUPS=3 declares the job's most nodes; nodes 0 and 1 start, node 2 joins later."""
    rows = 1200  # 400 a node: 100 steps of 4 before a node sees its share twice
    flags = [*TINY, "--max_steps", "40", "--step_delay", "0.05", "--logging_steps", "2", "--record_samples"]
    # stall_wait=0: nodes 0 and 1 are slowed (3 s a step) until node 2 trains, and node 2 waits for them meanwhile,
    # so one of them may rightly sit out for a few seconds (the default slow-node protection), which the samples
    # per step below would count as a shrink (it did once in a clean CI run: 8 samples from node 2's second step)
    flags += ["--train_rows", str(rows), *ft_args(",stall_wait=0")]
    slow = tmp_path / "slow_until_node2_trains"  # the others still train when node 2 arrives
    slow_nodes = ("--slow_while", str(slow), *LATE_NODE_WAIT)
    nodes = nodes_of(3, patient_lighthouse, tmp_path, *flags, processes=1, extra={0: slow_nodes, 1: slow_nodes})
    third_joins_two(nodes, slow)
    wait_until(lambda: nodes[2].step() > 0, 180, "node 2 to train", running=nodes)
    slow.unlink()
    finish(nodes)

    results = [node.result(0) for node in nodes]
    assert len({r["fingerprint"] for r in results}) == 1, "the nodes end with different parameters"
    assert all(r["global_step"] == 40 for r in results)
    assert nodes[2].log().count("took the parameters and training position from a live peer") == 1
    grew = r"quorum of live nodes: .*grew to 3 after \d+ \(node2 joined\)"
    assert re.search(grew, nodes[0].log()), nodes[0].log()[-3000:]
    assert re.search(r"quorum of live nodes: 3 node\(s\) \(node0, node1, node2\) after \d+ committed", nodes[2].log())
    # Samples per step: 4 a node, 8 with two nodes, 12 from node 2's first step on (x1.5).
    per_step = [value for _, value in results[0]["samples_per_step"]]
    before, after = per_step[: per_step.index(12)], per_step[per_step.index(12) :]
    assert before and before[-1] == 8 and set(before) <= {4, 8}, per_step  # node 0 may have trained alone at first
    assert set(after) == {12}, per_step

    # Each node read only its own share: NUM_REPLICA_GROUPS fixes the split, whoever is live.
    from support.tiny_hf import dataset, sample_hash, tokenizer

    from hf_flexdemo.fault_tolerance import NodeIdentity
    from hf_flexdemo.integrations.fault_tolerant_trainer import split_by_node

    data = dataset("olmo2", tokenizer(), rows=rows)
    for node in nodes:
        identity = NodeIdentity(patient_lighthouse.address, node.index, 3)
        share = {sample_hash(ids) for ids in split_by_node(data, identity)["input_ids"]}
        lines = (node.dir / "samples_rank0.jsonl").read_text().splitlines()
        read = [h for line in lines for h in json.loads(line)]
        assert read and set(read) <= share, f"node{node.index} read samples outside its share"


def committed_together(nodes: list[Node]) -> bool:
    """Every node of ``nodes`` has committed a step in a quorum of them all."""
    size = len(nodes)
    return all(
        any(p["replicas"] == size and p["committed"] > q["committed"] for q, p in itertools.pairwise(node.progress()))
        for node in nodes
    )


def third_joins_two(nodes: list[Node], slow) -> None:
    """Nodes 0 and 1 start (slowed while ``slow`` exists); once they train together, node 2 starts."""
    slow.touch()
    nodes[0].start()
    nodes[1].start()
    wait_until(lambda: committed_together(nodes[:2]), 180, "nodes 0 and 1 to train together", running=nodes[:2])
    nodes[2].start()


def said_by_us(nodes: list[Node], killed: int) -> None:
    """What the nodes print: our lines on quorum changes and healing, the summary; no torchft INFO lines."""
    survivor = nodes[1 - killed]
    log = survivor.log()
    shrinks = rf"the quorum shrinks from 2 to 1 live nodes \(node{killed} left; now node\d\) at \d+ committed steps"
    left = re.findall(shrinks + r"; (\d+) step\(s\) undone", log)
    assert len(left) == 1 and int(left[0]) <= 2, log[-6000:]
    assert re.search(rf"the quorum grows from 1 to 2 live nodes \(node{killed} joined", log), log[-6000:]
    for node in nodes:
        text = node.log()
        assert "[INFO] [torchft" not in text and "Connection closed by peer" not in text, text[-6000:]
        assert "from a live peer (0 steps committed" not in text  # the start-up sync loses nothing: not said
        summary = f"{LOST_NODE_STEPS} steps on 2 nodes x 2 processes (fault-tolerant; this is node {node.index})"
        assert summary in text and f"inter-node bytes sent by node {node.index}:" in text, text[-3000:]


def a_finished_job_is_not_started_over(node: Node) -> None:
    """Relaunched after its peers finished, with no checkpoint of its own: refused, not a fresh model alone."""
    model = node.dir / "result_rank0.json"
    before = model.read_bytes()
    node.start()
    assert node.wait(120) != 0
    log = node.log()
    assert "node1 joins a job whose last quorum had committed" in log, log[-6000:]
    assert "restart torchft_lighthouse" in log
    assert model.read_bytes() == before


KILLED_MID_EXCHANGE = ("random", "sparseloco")
"""One scheme for each collective: an all-reduce each step (random; full and striding run the same
collective) and an all-gather each inner_steps (sparseloco). The lost-node test kills the other two cadences
(demo's all-gather each step, diloco's all-reduce each inner_steps) at random moments. What every scheme undoes
for a step that does not commit is checked in one process, for all six, by
test_a_step_the_node_does_not_commit_leaves_no_trace."""


@pytest.mark.faults
@pytest.mark.parametrize("scheme", KILLED_MID_EXCHANGE)
def test_a_node_killed_mid_exchange_leaves_no_half_exchanged_step(patient_lighthouse, tmp_path, scheme):
    """Three single-process nodes; node 2 dies inside a collective of a step all three joined (step 10 on).

    Node 2 starts once nodes 0 and 1 train together, so that each survivor has a record of the
    step before the one node 2 dies in, whichever of them started first.
    """
    extra = ",inner_steps=5" if scheme == "sparseloco" else ""
    # Every node in every quorum once node 2 trains, so that it dies in a step all three joined (joining when
    # ready, it may be left out of that step and die in a later round).
    extra += ",join_quorum=before_forward"
    flags = [*TINY, "--max_steps", "40", "--step_delay", "0.05", *ft_args(f",scheme={scheme}{extra}")]
    slow = tmp_path / "slow_until_node2_died"  # the others still train when node 2 arrives
    slow_nodes = ("--slow_while", str(slow), *LATE_NODE_WAIT)
    extra_flags = {0: slow_nodes, 1: slow_nodes, 2: ("--kill_node_in_exchange_at", "10")}
    nodes = nodes_of(3, patient_lighthouse, tmp_path, *flags, processes=1, extra=extra_flags)
    third_joins_two(nodes, slow)
    # Once node 2 trains with them (or died in its first exchange), every step waits for it: no need to slow.
    with_node2 = lambda: committed_together(nodes) or nodes[2].proc.poll() is not None  # noqa: E731
    wait_until(with_node2, 180, "node 2 to train with the others", running=nodes[:2])
    slow.unlink()
    assert nodes[2].wait(180) != 0  # it killed itself
    finish(nodes[:2])
    recorded = nodes[2].progress()
    if recorded:
        died_in = recorded[-1]["step"] + 1
    else:  # it joined past step 10, healed, and died in its first exchange, the survivors' last of 3
        died_in = max(p["step"] for p in nodes[0].progress() if p["replicas"] == 3)
    for survivor in nodes[:2]:
        at = {p["step"]: p for p in survivor.progress()}
        assert at[died_in]["replicas"] == 3
        assert at[died_in]["committed"] == at[died_in - 1]["committed"], "a step whose exchange lost a node committed"
        assert any(p["replicas"] == 2 and p["committed"] > at[died_in]["committed"] for p in at.values())
    first, second = nodes[0].result(0), nodes[1].result(0)
    assert first["fingerprint"] == second["fingerprint"]
    assert first["committed"] == second["committed"]
    assert losses_fell(first)


@pytest.mark.faults
def test_a_node_dying_while_it_serves_recovery_does_not_take_the_healing_node_down(patient_lighthouse, tmp_path):
    """Node 2 starts late; the first of nodes 0 and 1 it asks for the live state dies; it heals from the other."""
    flags = [*TINY, "--max_steps", "60", "--step_delay", "0.1", *ft_args()]
    slow = tmp_path / "slow_until_node2_trains"  # the others still train when node 2 arrives
    armed = tmp_path / "die_while_serving"  # not before nodes 0 and 1 train together: one may heal from the other
    serve_and_die = ("--die_while_serving_when", str(armed), "--slow_while", str(slow), *LATE_NODE_WAIT)
    nodes = nodes_of(3, patient_lighthouse, tmp_path, *flags, processes=1, extra={0: serve_and_die, 1: serve_and_die})
    nodes[0].start()
    nodes[1].start()
    together = lambda: committed_together(nodes[:2]) and min(nodes[0].step(), nodes[1].step()) >= 6  # noqa: E731
    wait_until(together, 180, "nodes 0 and 1 to train together", running=nodes[:2])
    armed.touch()
    slow.touch()
    nodes[2].start()
    wait_until(lambda: any(n.proc.poll() is not None for n in nodes[:2]), 120, "the serving node to die")
    served = next(n for n in nodes[:2] if n.proc.poll() is not None)
    survivor = nodes[1 - served.index]
    wait_until(lambda: nodes[2].step() > 0, 120, "node 2 to train")
    slow.unlink()
    finish([survivor, nodes[2]])
    assert served.proc.returncode != 0
    assert survivor.result(0)["fingerprint"] == nodes[2].result(0)["fingerprint"]
    assert nodes[2].result(0)["global_step"] == 60


@pytest.mark.faults
def test_live_replicas_that_drift_apart_stop_with_replica_drift_error(tmp_path):
    # Both nodes start together: a node that joins late heals to the live step, past the corruption.
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=2)
    flags = [*TINY, "--max_steps", "40", "--logging_steps", "1", "--step_delay", "0.05", *ft_args(",min_replicas=2")]
    nodes = nodes_of(2, lighthouse, tmp_path, *flags, processes=1, extra={1: ("--corrupt_at", "8")})
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            assert node.wait(180) != 0
            assert "ReplicaDriftError" in node.log() and "replicas hold different parameters" in node.log()
    finally:
        lighthouse.stop()


@pytest.mark.multiprocess
def test_scheme_none_trains_each_node_alone(tmp_path):
    # The Lighthouse waits for both nodes: a node that starts alone must not run its steps in a quorum of one.
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=2)
    try:
        flags = [*TINY, "--max_steps", "6", *ft_args(",scheme=none,min_replicas=2")]
        nodes = nodes_of(2, lighthouse, tmp_path, *flags, processes=1)
        for node in nodes:
            node.start()
        finish(nodes)
    finally:
        lighthouse.stop()
    results = [node.result(0) for node in nodes]
    assert results[0]["committed"] == results[1]["committed"] >= 6  # every step committed by both
    assert results[0]["fingerprint"] != results[1]["fingerprint"]  # by design


@pytest.mark.multiprocess
def test_a_node_that_exits_with_an_exchange_pending_exits_cleanly(tmp_path):
    """Node 0 exits while its all-reduce waits for node 1. Left to the interpreter's teardown, the
    collective completed on a gloo thread that could no longer take the GIL: SIGABRT, "terminate
    called without an active exception", after a run that went well. The node frees its group at exit."""
    house = Lighthouse(tmp_path / "lighthouse.log", min_replicas=2)
    worker = str(Path(__file__).parent / "workers" / "exit_pending.py")
    try:
        nodes = [
            subprocess.Popen(
                [sys.executable, worker],
                env=child_env(TORCHFT_LIGHTHOUSE=house.address, REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS="2"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        house.stop()
    for i, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node{i} exited with {node.returncode}:\n{output[-3000:]}"
        assert "terminate called" not in output
    assert "node0 exits with its exchange pending" in outputs[0]
    assert "node1 summed [2.0, 2.0, 2.0, 2.0]" in outputs[1]


@pytest.mark.faults
def test_a_node_that_commits_no_step_fails(lighthouse, tmp_path):
    # The Lighthouse forms quorums of one (its --min_replicas 1) and the job needs two: every step fails to
    # commit, in a run shorter than the streak that stops a node. It must not exit as if it had trained.
    flags = [*TINY, "--max_steps", "3", *ft_args(",min_replicas=2")]
    node = nodes_of(2, lighthouse, tmp_path, *flags, processes=1)[0]
    node.start()
    assert node.wait(180) != 0
    assert "node0 finished training without committing a step" in node.log()
    assert "--min_replicas 2" in node.log()


# -- bad input and bad luck ----------------------------------------------------------------


@pytest.mark.faults
def test_an_unreachable_lighthouse_is_a_clear_error_within_the_timeout(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    # A node that waited for a quorum instead of failing at the 3 s timeout would outlast node.wait's deadline.
    flags = [*TINY, "--max_steps", "4", *ft_args(timeout=3, quorum_timeout=600)]
    node = Node(0, 1, address, tmp_path, *flags, config="cpu_ft_node.yaml")
    node.start()
    assert node.wait(120) != 0
    log = node.log()
    assert "could not join the Lighthouse" in log and f"TORCHFT_LIGHTHOUSE={address}" in log


@pytest.mark.faults
def test_too_few_nodes_wait_visibly_then_stop_with_checkpoints_whole(tmp_path):
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=2)  # the job's min_replicas: nodes wait
    flags = [*TINY, "--max_steps", "200", "--step_delay", "0.1", "--save_strategy", "steps", "--save_steps", "4"]
    nodes = nodes_of(2, lighthouse, tmp_path, *flags, *ft_args(",min_replicas=2", quorum_timeout=12), processes=1)
    for node in nodes:
        node.start()
    wait_until(lambda: nodes[1].step() >= 6, 180, "both nodes to train")
    nodes[1].kill()
    code = nodes[0].wait(90)
    log = nodes[0].log()
    assert code != 0
    assert "has waited" in log and "min_replicas=2" in log and "missing ['node1']" in log
    assert "could not join a quorum of min_replicas=2 live nodes (quorum_timeout=12 s)" in log
    from hf_flexdemo.integrations.checkpoints import checkpoints, incomplete_reason

    saved = checkpoints(nodes[0].dir)
    lighthouse.stop()
    assert saved, "no checkpoint was written before the stop"
    assert all(incomplete_reason(folder) is None for _, folder in saved)


@pytest.mark.faults
def test_a_node_relaunched_alone_resumes_its_checkpoint_with_its_committed_steps(lighthouse, tmp_path):
    """Lost past checkpoint-5, the node relaunched alone resumes it, its committed steps too, and says it is behind."""
    flags = [*TINY, "--max_steps", "12", "--step_delay", "0.2", "--save_strategy", "steps", "--save_steps", "5"]
    slow = tmp_path / "slow_until_killed"  # the kill lands before checkpoint-10, however late the test looks
    node = nodes_of(1, lighthouse, tmp_path, *flags, *ft_args(), processes=1, extra={0: ("--slow_while", str(slow))})[0]
    slow.touch()
    node.start()
    wait_until(lambda: node.step() >= 7, 180, "the node to pass checkpoint-5", running=[node])
    node.kill()
    slow.unlink()
    checkpoint = node.dir / "checkpoint-5"
    assert "flexdemo_quorum.json" in (checkpoint / MARKER).read_text()  # inside the marker
    saved = json.loads((checkpoint / "flexdemo_quorum.json").read_text())["step"]
    node.start()  # the same command
    finish([node])
    log = node.log()
    assert f"Resuming from {checkpoint}, the newest complete checkpoint of an earlier run" in log, log[-6000:]
    behind = rf"resumes from its checkpoint at {saved} committed steps, behind the \d+ of the job's last quorum"
    assert re.search(behind, log), log[-6000:]
    assert node.result(0)["global_step"] == 12 and node.result(0)["committed"] >= saved + 7


@pytest.mark.faults
def test_a_node_with_other_settings_is_refused_and_a_lost_lighthouse_then_stops_the_node_with_its_address(
    lighthouse, tmp_path
):
    """Node 1 (topk=4) meets node 0 (topk=8): it is refused and node 0 trains on undisturbed. Then the Lighthouse
    is lost: node 0 stops, naming its address."""
    flags = [*TINY, "--max_steps", "400", "--step_delay", "0.1"]
    slow = tmp_path / "slow_until_node1_stopped"  # node 0 still trains when node 1 arrives
    nodes = nodes_of(
        2, lighthouse, tmp_path, *flags, processes=1, extra={0: ("--slow_while", str(slow), *LATE_NODE_WAIT)}
    )
    nodes[0].command += ft_args(quorum_timeout=10)
    nodes[1].command += ft_args(topk=4, quorum_timeout=10)
    slow.touch()
    nodes[0].start()
    wait_until(lambda: nodes[0].step() >= 2, 120, "node0 to train", running=nodes[:1])
    nodes[1].start()
    assert nodes[1].wait(180) != 0
    slow.unlink()
    assert "flexdemo.settings.topk: node0 has 8, this node 4" in nodes[1].log()
    # The running node is not disturbed: it commits steps on its own after the refusal.
    refused_at, committed = time.time(), nodes[0].progress()[-1]["committed"]
    more = lambda: any(p["time"] > refused_at and p["committed"] >= committed + 4 for p in nodes[0].progress())  # noqa: E731
    wait_until(more, 120, "node0 to train on after the refusal", running=nodes[:1])
    lighthouse.stop()
    assert nodes[0].wait(120) != 0
    assert lighthouse.address in nodes[0].log(), nodes[0].log()[-6000:]


class StandInHealing:
    """What a healing node is served, and what this one's heal did (ManagedReplicas.healing's part)."""

    def __init__(self, behind: list[int] | None = None):
        self.served, self.behind, self.caught_up, self.copied = {}, behind, None, None

    def register(self, key, state, load):
        self.served[key] = (state, load)

    def describe(self, part, describe):
        pass

    def healing_steps(self):
        return self.behind

    def note_catch_up(self, steps, moved, copy):
        self.caught_up = (steps, moved, copy)

    def note_copy(self, copied):
        self.copied = copied


class StandInEnd:
    """Whether the node (or the peer it healed from) finished training (ManagedReplicas.end's part)."""

    def __init__(self):
        self.finished = False
        self.behind_at_close = False

    def agree_on_finished(self) -> bool:
        return self.finished


class OneReplicaQuorum:
    """Stands in for ManagedReplicas in one process: one replica, each commit decided by the test. It has the real
    one's parts that the optimizer uses (``quorum``, ``healing``, ``end``)."""

    device = torch.device("cpu")

    def __init__(self, commits: list[bool]):
        self.commits = list(commits)
        self.step = self.steps_before_quorum = 0  # committed steps, as torchft counts them
        self.quorum = SimpleNamespace(round_open=False)
        self.healing = StandInHealing()
        self.end = StandInEnd()
        self.clock = RoundClock()

    def begin(self) -> bool:
        self.quorum.round_open = True
        return False

    def commit(self, trained: bool = True) -> bool:
        self.quorum.round_open = False
        committed = self.commits.pop(0)
        self.step += committed
        return committed

    def topology(self):
        return ReplicaTopology.single()


def _tiny_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((16, 12), (7,), (5, 3, 3))]


def _read_by_the_scheme(hp: dict) -> dict:
    """``hp`` less the settings its scheme does not read (topk on diloco, rate on demo): given, they are refused."""
    reads = traits_of(hp.get("scheme", "demo")).reads
    return {key: value for key, value in hp.items() if key not in SCHEME_SETTINGS or key in reads}


def _grads(step: int, params):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


@pytest.mark.unit
@pytest.mark.parametrize("scheme", [*ALL_SCHEMES, "none", *UPDATE_RULES])
def test_a_step_the_node_does_not_commit_leaves_no_trace(scheme):
    """Steps 1, 2 commit, step 3 does not, step 4 does: the same as a twin that never saw step 3."""
    hp = dict(scheme=scheme, lr=0.05, weight_decay=0.1, topk=3, chunk=4, rate=0.25, inner_steps=2, value_bits=0)
    if scheme in UPDATE_RULES:
        hp.update(scheme="demo", **UPDATE_RULES[scheme])
    if scheme in ("demo", "sparseloco"):
        hp.update(value_bits=2, rounding="stochastic")
    hp = _read_by_the_scheme(hp)
    params, twins = _tiny_params(), _tiny_params()
    opt, twin = FlexDeMo(params, **hp), FlexDeMo(twins, **hp)
    wrap_optimizer(opt, OneReplicaQuorum([True, True, False, True]))
    wrap_optimizer(twin, OneReplicaQuorum([True, True, True]))
    for step, twin_step in ((0, 0), (1, 1), (2, None), (3, 2)):
        before = ([p.detach().clone() for p in params], copy_state(opt))
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
        if twin_step is None:  # not committed: parameters and every state tensor as they were
            assert all(torch.equal(a, b) for a, b in zip(before[0], params))
            assert copy_state(opt) == before[1]
            continue
        for p, g in zip(twins, _grads(step, twins)):
            p.grad = g
        twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
    assert copy_state(opt) == copy_state(twin)


@pytest.mark.unit
def test_a_fault_tolerant_optimizer_that_no_node_wraps_is_refused_at_its_step_and_wraps_after_a_load():
    """fault_tolerance=torchft in a loop that forgot the wrapper would train alone; a state loaded before wrapping
    (a resume in one's own loop) keeps the node's own layout."""
    params = _tiny_params()
    opt = FlexDeMo(params, lr=0.05, topk=3, chunk=4, fault_tolerance="torchft")
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    with pytest.raises(
        RuntimeError, match=r"fault_tolerance='torchft' but no node wraps this optimizer.*wrap_optimizer"
    ):
        opt.step()
    trained = FlexDeMo(_tiny_params(), lr=0.05, topk=3, chunk=4)
    for p, g in zip(trained.param_groups[0]["params"], _grads(0, params)):
        p.grad = g
    trained.step()
    resumed = FlexDeMo(_tiny_params(), lr=0.05, topk=3, chunk=4)
    resumed.load_state_dict(trained.state_dict())
    wrap_optimizer(resumed, OneReplicaQuorum([True]))
    assert resumed.wrapped_by is not None and resumed.store is not None


@pytest.mark.unit
def test_a_step_under_a_quorum_copies_no_parameters_when_weight_decay_waits_for_the_commit(monkeypatch):
    """The undo snapshot of a step: weight decay moves the parameters only after the vote, so no copy of them."""
    from hf_flexdemo.buckets import Bucket

    params = _tiny_params()
    opt = FlexDeMo(params, lr=0.05, weight_decay=0.1, topk=3, chunk=4)
    wrap_optimizer(opt, OneReplicaQuorum([True, False, True]))
    copies = []
    monkeypatch.setattr(Bucket, "stacked_params", lambda bucket: copies.append(bucket) or torch.stack(bucket.params))
    for step in range(3):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
    assert copies == []


def copy_state(opt) -> dict:
    """Every state tensor as bytes, comparable with ==."""
    return {
        (i, key): value.detach().clone().numpy().tobytes()
        for i, p in enumerate(p for group in opt.param_groups for p in group["params"])
        for key, value in opt.state[p].items()
        if hasattr(value, "numpy")
    }


@pytest.mark.unit
@pytest.mark.parametrize("scheme", ["demo", "diloco", "demo_adam"])
def test_a_healing_node_takes_parameters_shared_state_and_the_learning_rate(scheme):
    hp = dict(scheme=scheme)
    if scheme in UPDATE_RULES:
        hp.update(scheme="demo", **UPDATE_RULES[scheme])
    hp = _read_by_the_scheme(hp | dict(lr=0.05, topk=3, chunk=4, inner_steps=3))
    peer_params, mine = _tiny_params(0), _tiny_params(1)
    peer, node = FlexDeMo(peer_params, **hp), FlexDeMo(mine, **hp)
    for step in range(4):
        for p, g in zip(peer_params, _grads(step, peer_params)):
            p.grad = g
        peer.step()
    peer.param_groups[0]["lr"] = 0.0123  # where the peer's scheduler is
    ft(node).load_replica_state(ft(peer).replica_state())
    assert node.param_groups[0]["lr"] == 0.0123
    for p, q in zip(mine, peer_params):
        assert int(node.state[p]["step"]) == int(peer.state[q]["step"]) == 4
        if scheme == "diloco":  # the inner loop restarts from the anchor, not from the peer's inner progress
            assert torch.equal(p.detach(), peer.state[q]["anchor"])
            assert torch.equal(node.state[p]["outer_momentum"], peer.state[q]["outer_momentum"])
        else:
            assert torch.equal(p.detach(), q.detach())
            assert "momentum_dct" not in node.state[p]  # its own momentum: none yet, zeros at its first step
        if scheme == "demo_adam":  # the rule's second moment, equal on every replica
            assert peer.state[q]["update_sq"].any() and torch.equal(
                node.state[p]["update_sq"], peer.state[q]["update_sq"]
            )


class LaggingPeers(OneReplicaQuorum):
    """OneReplicaQuorum that commits every step, with the committed steps of the nodes healing from it."""

    def __init__(self, behind: list[int] | None = None):
        super().__init__([True] * 100)
        self.healing = StandInHealing(behind)

    def fingerprints_of_leaders(self, fingerprint, unapplied=0, closing=False):
        self.compared = int(fingerprint)
        return [int(fingerprint)]


REPLAYED = {
    "demo": dict(scheme="demo", value_bits=2, rounding="stochastic"),
    "demo_elias_fano": dict(scheme="demo", value_bits=2, pack_indices=True, index_coding="elias_fano"),  # wire=2bit
    "demo_ortho_adam": dict(scheme="demo", **UPDATE_RULES["demo_ortho_adam"]),
    "demo_adam": dict(scheme="demo", **UPDATE_RULES["demo_adam"]),
    "random": dict(scheme="random"),
    "demo_every_2": dict(scheme="demo", replicate_every=2),  # the peer's synchronize() exchanges: replayed too
}
"""Schemes that replay (``full`` sends every entry: one of its steps is already a copy of the state)."""


def _wide_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 48), (48,), (8, 6, 6))]


def lagging_pair(settings: dict, replay_steps: int | None = None, missed: int = 3):
    """A peer that commits 2 + ``missed`` steps, and a node that committed the first 2 with it, then none."""
    # before_forward: the peer's and the node's synchronize() rounds commit (nodes that join when ready skip them;
    # the slow-node tests cover replay there, node against node)
    hp = dict(lr=0.05, weight_decay=0.1, topk=4, chunk=16, rate=1 / 64, fault_tolerance="torchft")
    hp = _read_by_the_scheme(hp | dict(join_quorum="before_forward") | settings)
    peer_params, mine = _wide_params(), _wide_params()
    peer, node = FlexDeMo(peer_params, replay_steps=replay_steps, **hp), FlexDeMo(mine, **hp)
    wrap_optimizer(peer, LaggingPeers(behind=[2]))
    wrap_optimizer(node, LaggingPeers())
    for step in range(2 + missed):
        for opt, params in ((peer, peer_params), (node, mine))[: 1 if step >= 2 else 2]:
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            opt.step()
            opt.param_groups[0]["lr"] *= 0.9  # a scheduler: each replayed step takes its own rate
    peer.synchronize()  # a save or an evaluation: a round that is not a training step
    ft(node).managed.steps_before_quorum = ft(node).managed.step
    return peer, node, peer_params, mine


@pytest.mark.unit
@pytest.mark.parametrize("settings", REPLAYED.values(), ids=REPLAYED.keys())
def test_a_node_that_missed_steps_replays_their_payloads_and_ends_bitwise_equal(settings):
    peer, node, peer_params, mine = lagging_pair(settings)
    served = ft(peer).replica_state()
    missed = list(range(3, ft(peer).managed.step + 1))
    assert "params" not in served and [step.committed for step in served["replay"]] == missed
    ft(node).load_replica_state(served)
    ft(node).managed.step = ft(peer).managed.step  # as torchft's heal sets it
    assert ft(node).managed.healing.caught_up[0] == len(missed) and ft(node).managed.healing.caught_up[1] > 0
    assert not all(torch.equal(a, b) for a, b in zip(mine, peer_params))  # applied at the node's next commit
    node.synchronize()  # a round that exchanges nothing: the commit replays the missed steps
    assert all(torch.equal(a, b) for a, b in zip(mine, peer_params))
    keep = ft(node).replica.shared_keys()
    for p, q in zip(mine, peer_params):
        for key in keep:
            if key in peer.state[q]:
                assert torch.equal(node.state[p][key], peer.state[q][key]), key
    assert node.param_groups[0]["lr"] == peer.param_groups[0]["lr"]
    served_on = [step.committed for step in ft(node).replica.replay._steps][-2:]
    assert served_on == [missed[-1], missed[-1] + 1]  # it serves on


ENCODES_FIRST = dict(scheme="demo", value_bits=2)
"""DeMo with deterministic rounding: a node that joins when ready encodes its payload before asking for a quorum
(stochastic rounding draws by the quorum's step and rank, so it encodes after joining)."""


@pytest.mark.unit
@pytest.mark.parametrize("settings", [REPLAYED["demo"], ENCODES_FIRST], ids=["joins_first", "encodes_first"])
def test_a_late_node_healed_by_a_finished_one_catches_up_and_drops_its_gradient_past_the_end(settings):
    """The closing round: the peer finished training; the node's step catches up and sends nothing."""
    peer, node, peer_params, mine = lagging_pair(settings | {"join_quorum": "when_ready"})
    ft(node).load_replica_state(ft(peer).replica_state())
    ft(node).managed.step = ft(peer).managed.step
    ft(node).managed.end.finished = True  # what the finished peer serves under ROUND_STATE_KEY
    momentum = [node.state[p]["momentum_dct"].clone() for p in mine]
    for p, g in zip(mine, _grads(9, mine)):
        p.grad = g
    node.step()
    assert all(torch.equal(a, b) for a, b in zip(mine, peer_params))
    assert all(int(node.state[p]["step"]) == int(peer.state[q]["step"]) for p, q in zip(mine, peer_params))
    assert all(torch.equal(node.state[p]["momentum_dct"], m) for p, m in zip(mine, momentum))  # gradient dropped
    assert ft(node).managed.compared == int(parameter_fingerprint(mine))  # the round compares the nodes' parameters
    assert not ft(node).managed.end.behind_at_close


@pytest.mark.unit
@pytest.mark.parametrize("settings", [REPLAYED["demo"], ENCODES_FIRST], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("join_quorum", ["before_forward", "when_ready"])
def test_a_gradient_taken_before_a_catch_up_counts_only_for_a_node_that_joins_when_ready(join_quorum, settings):
    peer, node, _, mine = lagging_pair(settings | {"join_quorum": join_quorum})
    ft(node).load_replica_state(ft(peer).replica_state())
    ft(node).managed.step = ft(peer).managed.step
    decay = node.param_groups[0]["decay"]
    decayed = [node.state[p]["momentum_dct"] * decay for p in mine]
    for p, g in zip(mine, _grads(9, mine)):
        p.grad = g
    node.step()
    # Without the gradient the momentum is decay * m less what was sent (4 of each tile's 256 coefficients);
    # with it, lr * DCT(g) moves nearly every entry.
    moved = [torch.count_nonzero(node.state[p]["momentum_dct"] - d) / d.numel() for p, d in zip(mine, decayed)]
    assert (join_quorum == "when_ready") == (min(moved) > 0.5), moved


@pytest.mark.unit
def test_a_node_that_encodes_first_and_heals_as_it_joins_steps_at_the_quorums_learning_rate():
    """Its payload was encoded at its own rate; the heal in its join brings the peers' (a scheduler ahead), and
    the step applies, decays and logs for replay at that one, as every node of the quorum does."""
    peer, node, peer_params, mine = lagging_pair(ENCODES_FIRST | {"join_quorum": "when_ready"})
    served, begin = ft(peer).replica_state(), ft(node).managed.begin

    def heal_while_joining() -> bool:
        ft(node).load_replica_state(served)
        ft(node).managed.step = ft(peer).managed.step
        begin()
        return True

    ft(node).managed.begin = heal_while_joining
    assert node.param_groups[0]["lr"] != peer.param_groups[0]["lr"]
    applied = []
    apply_rules = node.applier.apply_rules
    node.applier.apply_rules = lambda batch, ctx: (
        applied.append({d.bucket.group["lr"] for d in batch}) or apply_rules(batch, ctx)
    )
    for p, g in zip(mine, _grads(9, mine)):
        p.grad = g
    node.step()
    lr = peer.param_groups[0]["lr"]
    assert applied[-1] == {lr}, (applied, lr)  # after the replayed steps, each at its own rate
    assert ft(node).replica.replay._steps[-1].groups[0]["lr"] == lr  # what a peer of this node would replay


@pytest.mark.unit
def test_a_node_that_joins_when_ready_encodes_first_and_steps_exactly_as_one_that_joins_first():
    """when_ready: DeMo's payload is ready before the node asks for its quorum, so a node stalled while encoding
    holds nobody; the step is the same, bit for bit, as joining first (which before_forward does)."""
    order: dict[str, list[str]] = {}
    results = {}
    for join_quorum in ("before_forward", "when_ready"):
        params = _wide_params()
        opt = FlexDeMo(params, lr=0.05, weight_decay=0.1, topk=4, chunk=16, fault_tolerance="torchft",
                       join_quorum=join_quorum, **ENCODES_FIRST)  # fmt: skip
        managed = OneReplicaQuorum([True] * 10)
        wrap_optimizer(opt, managed)
        events = order.setdefault(join_quorum, [])
        begin, local_step = managed.begin, opt.scheme.local_step
        managed.begin = lambda _b=begin, _e=events: _e.append("join") or _b()
        opt.scheme.local_step = lambda bucket, ctx, _f=local_step, _e=events: _e.append("encode") or _f(bucket, ctx)
        for step in range(4):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            events.append("step")
            opt.step()
        results[join_quorum] = [p.detach().clone() for p in params], copy_state(opt)
    # The first step creates the state after joining; from then on a node that joins when ready encodes first
    # (every bucket, then the join).
    collapsed = {name: [event for event, _ in itertools.groupby(events)] for name, events in order.items()}
    assert collapsed["before_forward"] == ["step", "join", "encode"] * 4
    assert collapsed["when_ready"] == ["step", "join", "encode"] + ["step", "encode", "join"] * 3
    (first, first_state), (ready, ready_state) = results.values()
    assert all(torch.equal(a, b) for a, b in zip(first, ready))
    assert first_state == ready_state


@pytest.mark.unit
def test_a_node_with_steps_to_replay_numbers_its_next_step_as_its_peers_do():
    """random picks its entries by step number: a node still to replay must pick the peers' entries."""
    peer, node, peer_params, mine = lagging_pair(REPLAYED["random"])
    ft(node).load_replica_state(ft(peer).replica_state())
    ft(node).managed.step = ft(peer).managed.step
    steps = {}
    for name, opt, params in (("peer", peer, peer_params), ("node", node, mine)):
        local_step = opt.scheme.local_step
        opt.scheme.local_step = lambda bucket, ctx, _f=local_step, _n=name: (
            steps.setdefault(_n, ctx.step) and _f(bucket, ctx)
        )
        for p, g in zip(params, _grads(9, params)):
            p.grad = g
        opt.step()
    assert steps["node"] == steps["peer"], steps
    assert torch.equal(node.state[mine[0]]["step"], peer.state[peer_params[0]]["step"])


@pytest.mark.unit
def test_a_node_further_behind_than_replay_steps_copies_the_whole_state():
    peer, node, peer_params, mine = lagging_pair(REPLAYED["demo"], replay_steps=2, missed=3)
    served = ft(peer).replica_state()
    assert "replay" not in served and "params" in served
    ft(node).load_replica_state(served)
    assert all(torch.equal(a, b) for a, b in zip(mine, peer_params))
    assert ft(node).managed.healing.copied > 0 and ft(node).managed.healing.caught_up is None


@pytest.mark.unit
def test_scheme_full_copies_the_state_since_one_step_of_it_is_a_copy():
    peer, _, _, _ = lagging_pair(dict(scheme="full"), missed=1)
    assert "params" in ft(peer).replica_state()


@pytest.mark.unit
def test_a_new_node_copies_the_whole_state_even_when_the_steps_are_held():
    peer, _, _, _ = lagging_pair(REPLAYED["demo"], missed=1)
    ft(peer).managed.healing.behind = [0]  # it never committed a step of this job: its parameters are not the job's
    assert "params" in ft(peer).replica_state()
