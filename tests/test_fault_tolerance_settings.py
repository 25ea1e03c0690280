"""Fault tolerance in one process: the node's settings, the torchft API we call, the Lighthouse's view.

The launches with a real Lighthouse and SIGKILLed nodes are in tests/test_fault_tolerance.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import pytest
from support.launch import free_port, wait_for

from hf_flexdemo.config import FlexDeMoConfig
from hf_flexdemo.fault_tolerance import NodeIdentity
from hf_flexdemo.fault_tolerance.lighthouse import LighthouseView, job_state_verdict, read_lighthouse
from hf_flexdemo.fault_tolerance.node import FaultToleranceError
from hf_flexdemo.fault_tolerance.quorum import StepQuorum

pytest.importorskip("torchft", reason="torchft is part of the test install (setup.cfg [test])")

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "environ,message",
    [
        ({}, "TORCHFT_LIGHTHOUSE (unset)"),
        ({"TORCHFT_LIGHTHOUSE": "10.0.0.1:29510"}, "write it as http://<host>:<port>"),
        ({"TORCHFT_LIGHTHOUSE": "http://h:1", "REPLICA_GROUP_ID": "0"}, "needs NUM_REPLICA_GROUPS"),
        ({"TORCHFT_LIGHTHOUSE": "http://h:1", "NUM_REPLICA_GROUPS": "2"}, "needs REPLICA_GROUP_ID"),
        (
            {"TORCHFT_LIGHTHOUSE": "http://h:1", "NUM_REPLICA_GROUPS": "2", "REPLICA_GROUP_ID": "2"},
            "REPLICA_GROUP_ID=2 is invalid with NUM_REPLICA_GROUPS=2",
        ),
    ],
)
def test_the_node_identity_is_checked_with_a_fix(environ, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        NodeIdentity.from_env(environ=environ)


def test_min_replicas_above_the_node_count_and_overlap_are_refused():
    env = {"TORCHFT_LIGHTHOUSE": "http://h:1", "NUM_REPLICA_GROUPS": "2", "REPLICA_GROUP_ID": "0"}
    with pytest.raises(ValueError, match="min_replicas=3 is more than NUM_REPLICA_GROUPS=2"):
        NodeIdentity.from_env(3, environ=env)
    with pytest.raises(ValueError, match="overlap=True cannot be combined with fault_tolerance='torchft'"):
        FlexDeMoConfig(fault_tolerance="torchft", overlap=True)
    with pytest.raises(ValueError, match="fault_tolerance='on' is invalid"):
        FlexDeMoConfig(fault_tolerance="on")


def test_the_torchft_api_we_use_is_where_we_call_it():
    import inspect

    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    params = inspect.signature(Manager.__init__).parameters
    for name in (
        "use_async_quorum",
        "init_sync",
        "min_replica_size",
        "quorum_timeout",
        "lighthouse_addr",
        "replica_id",
    ):
        assert name in params, f"torchft Manager({name}=) moved"
    for name in ("register_state_dict_fn", "start_quorum", "should_commit", "report_error", "errored", "current_step"):
        assert hasattr(Manager, name), f"torchft Manager.{name} moved"
    assert "timeout" in inspect.signature(Manager.should_commit).parameters  # the vote waits longer than an exchange
    for name in ("allgather", "allreduce", "configure"):
        assert hasattr(ProcessGroupGloo, name)
    # QuorumWatch stands in for the manager's private client to learn each quorum's members.
    from torchft._torchft import ManagerClient, QuorumResult

    assert "self._client._quorum(" in inspect.getsource(Manager._async_quorum)
    assert hasattr(ManagerClient, "_quorum") and "replica_ids" in dir(QuorumResult)
    assert hasattr(Manager, "state_dict") and hasattr(Manager, "load_state_dict")  # a resumed node's commit count
    assert os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"))


class VoteTimesOut:
    """torchft's manager where the node's other processes do not vote in time: its client raises TimeoutError."""

    def errored(self):
        return None

    def num_participants(self):
        return 2

    def should_commit(self, timeout):
        self.waited = timeout.total_seconds()
        raise TimeoutError('status: Cancelled, message: "Timeout expired"')


def test_a_process_whose_siblings_do_not_vote_waits_two_exchanges_then_stops_the_node_with_what_to_change():
    manager = VoteTimesOut()
    quorum = StepQuorum(manager, NodeIdentity("http://localhost:1", 0, 2), FlexDeMoConfig(ft_timeout=5.0), rank=1)
    waited = r"process 1 of node0 waited 10 s \(twice ft_timeout=5\).*raise ft_timeout"
    with pytest.raises(FaultToleranceError, match=waited):
        quorum.commit(trained=True)
    assert manager.waited == 10  # a sibling whose exchange waited out ft_timeout votes that much later


def test_nccl_nodes_bound_nonblocking_nccl_by_ft_timeout_without_torchfts_warning(monkeypatch):
    """On CUDA torchft's group warns at every node start unless TORCH_NCCL_NONBLOCKING_TIMEOUT is set, then sets
    it to its timeout: the node sets the same value first; a value the user set stands."""
    import inspect

    from torchft.process_group import ProcessGroupNCCL

    from hf_flexdemo.fault_tolerance import NCCL_NONBLOCKING_TIMEOUT_ENV, nccl_nonblocking_timeout

    assert NCCL_NONBLOCKING_TIMEOUT_ENV in inspect.getsource(ProcessGroupNCCL.__init__), "torchft moved the variable"
    monkeypatch.delenv(NCCL_NONBLOCKING_TIMEOUT_ENV, raising=False)
    nccl_nonblocking_timeout(30)
    assert os.environ[NCCL_NONBLOCKING_TIMEOUT_ENV] == "30.0"  # what torchft writes for timedelta(seconds=30)
    monkeypatch.setenv(NCCL_NONBLOCKING_TIMEOUT_ENV, "600")
    nccl_nonblocking_timeout(30)
    assert os.environ[NCCL_NONBLOCKING_TIMEOUT_ENV] == "600"


@contextlib.contextmanager
def in_process_lighthouse(**options):
    """torchft's Lighthouse server in this process, and a client of it: ``(address, client)``."""
    from datetime import timedelta

    from torchft._torchft import LighthouseClient, LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", **options)
    try:
        address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
        yield address, LighthouseClient(address, timedelta(seconds=5))
    finally:
        server.shutdown()


def quorum_request(seconds: float = 5) -> dict:
    """The rest of a LighthouseClient.quorum() call, for a stand-in node."""
    from datetime import timedelta

    return dict(timeout=timedelta(seconds=seconds), address="x", store_address="y", world_size=1, shrink_only=False)


def test_the_waiting_message_names_who_is_missing_from_the_lighthouse():
    from hf_flexdemo.fault_tolerance import lighthouse_status

    with in_process_lighthouse(min_replicas=2, heartbeat_timeout_ms=500) as (address, client):
        client.heartbeat("node1:a")

        def node1_dropped() -> str | None:  # node1 falls silent; node0 keeps heartbeating
            client.heartbeat("node0:b")
            status = lighthouse_status(address)
            return status if "heartbeating ['node0']" in status else None

        status = wait_for(node1_dropped, 30, "the Lighthouse to drop the silent node1", poll=0.1)
        assert "need min_replicas 2" in status
    assert "does not answer" in lighthouse_status(f"http://127.0.0.1:{free_port()}")


def test_the_lighthouse_view_holds_the_last_quorums_steps():
    # node0 must stay live until the view is read, however slow the machine: a long heartbeat timeout.
    with in_process_lighthouse(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=60_000) as (address, client):
        client.heartbeat("node0:a1")
        client.quorum(replica_id="node0:a1", step=57, **quorum_request())
        view = read_lighthouse(address)
        assert view.last_quorum == {"node0:a1": 57} and view.job_step == 57
        assert view.heartbeating == {"node0:a1"}


def test_a_node_that_would_start_a_finished_job_over_is_refused_and_a_resumed_one_is_told():
    before = LighthouseView(last_quorum={"node0:a": 100, "node1:b": 97})
    gone = LighthouseView(heartbeating=frozenset({"node1:new"}))  # only the relaunched node itself
    kind, message = job_state_verdict(before, gone, "node1", 0, resumed=False)
    assert kind == "refuse" and "last quorum had committed 100 steps (node0 at 100, node1 at 97)" in message
    assert "restart torchft_lighthouse" in message
    kind, message = job_state_verdict(before, gone, "node1", 60, resumed=True)
    assert kind == "warn" and "resumes from its checkpoint at 60 committed steps, behind the 100" in message
    late = LighthouseView(heartbeating=frozenset({"node0:a"}))  # a peer that holds the steps, only slow to join
    assert job_state_verdict(before, late, "node1", 0, resumed=False) is None
    assert job_state_verdict(before, gone, "node1", 100, resumed=False) is None  # healed to the job's state
    assert job_state_verdict(LighthouseView(), gone, "node1", 0, resumed=False) is None  # a new job


def test_the_summary_tells_how_the_quorum_grew_and_shrank():
    from hf_flexdemo.fault_tolerance.membership import membership_story

    membership = [
        (0, ("node0", "node1")),
        (51, ("node0", "node1", "node2")),
        (120, ("node0", "node2")),
        (130, ("node0", "node1", "node3")),
    ]
    assert membership_story(membership, step=140) == (
        "2 node(s) (node0, node1) after 0 committed steps; grew to 3 after 51 (node2 joined); "
        "shrank to 2 after 120 (node1 left); grew to 3 after 130 (node2 left; node1, node3 joined); "
        "140 committed steps in all"
    )
    assert membership_story([], step=0) == "no quorum met"
    # A node that is always late comes and goes every few steps: the story stays one readable line.
    flapping = [(0, ("node0", "node1"))] + [
        (10 * i, ("node0", "node1", "node2") if i % 2 else ("node0", "node1")) for i in range(1, 21)
    ]
    story = membership_story(flapping, step=205)
    assert story.count("after") == 7 and "14 more change(s)" in story
    assert story.endswith("shrank to 2 after 200 (node2 left); 205 committed steps in all")


def test_a_node_warns_at_the_end_only_about_nodes_it_cannot_vouch_for():
    from hf_flexdemo.fault_tolerance import NodeIdentity
    from hf_flexdemo.fault_tolerance.closing import ending_note

    name = NodeIdentity("http://127.0.0.1:1", 2, 3).name
    three = (0, ("node0", "node1", "node2"))
    # Its last quorum lost node0 and node1, and nothing says they ended on its model.
    note = ending_note(name, [three, (68, ("node2",))], step=69, behind_at_close=False)
    assert "node2 cannot tell whether node0, node1 ended on its model" in note
    assert "from 68 committed steps on: node2; 69 committed steps here" in note
    # They finished in a closing round after the job's last step, whose nodes compared checksums: no warning.
    assert ending_note(name, [three, (68, ("node2",))], 69, False, frozenset({"node0", "node1", "node2"})) == ""
    # Only the one it cannot vouch for is named; the nodes of its last quorum committed its last round with it.
    note = ending_note(name, [three, (60, ("node1", "node2"))], 69, False, frozenset({"node1", "node2"}))
    assert "whether node0 ended" in note
    assert ending_note(name, [three], step=70, behind_at_close=False) == ""
    # Its last round did not commit, and the nodes that finished had left: it says it is behind.
    assert "node2 ended training behind the others" in ending_note(name, [three], step=69, behind_at_close=True)


def test_the_lighthouse_view_counts_the_nodes_waiting_for_a_quorum():
    """A node that finished training joins a closing round only when a late node waits for one."""
    options = dict(min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=60_000)
    with in_process_lighthouse(**options) as (address, client):
        client.heartbeat("node0:a")
        client.heartbeat("node1:b")
        assert read_lighthouse(address).waiting == 0
        late = threading.Thread(target=lambda: client.quorum(replica_id="node1:b", step=3, **quorum_request(30)))
        late.start()
        wait_for(lambda: read_lighthouse(address).waiting == 1, 10, "node1 to wait for a quorum", poll=0.05)
        client.quorum(replica_id="node0:a", step=4, **quorum_request(30))  # the finished node joins: it forms
        late.join(10)
        view = read_lighthouse(address)
        assert view.waiting == 0 and view.last_quorum == {"node0:a": 4, "node1:b": 3}


def test_a_finished_node_serves_the_position_before_the_jobs_last_step_even_if_it_healed_in_it():
    """A late node that catches up from a finished one counts its own last step as the job's last."""
    from types import SimpleNamespace

    from hf_flexdemo.integrations.fault_tolerant_trainer import NodePosition

    replicas = SimpleNamespace(end=SimpleNamespace(finished=False))
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=10, epoch=1.0), lr_scheduler=None)
    position = NodePosition(replicas, trainer)
    position.on_step_begin(None, trainer.state, None)
    position.take({"global_step": 39, "epoch": 3.9, "scheduler": None})  # healed in its last step (when_ready)
    trainer.state.global_step += 1  # the Trainer counts the step: 40, the job's last
    replicas.end.finished = True
    assert position.serve() == {"global_step": 39, "epoch": 3.9, "scheduler": None, "final": True}
    position.ended = True  # a closing round after its loop ended: it keeps its own position
    position.take({"global_step": 39, "epoch": 3.9, "scheduler": None, "final": True})
    assert trainer.state.global_step == 40


def test_a_process_is_one_node_and_a_second_config_for_it_is_refused(monkeypatch):
    from types import SimpleNamespace

    from hf_flexdemo.fault_tolerance import replicas

    first = FlexDeMoConfig(fault_tolerance="torchft")
    node = SimpleNamespace(config=first)
    monkeypatch.setattr(replicas, "_NODE", node)
    assert replicas.node_replicas(FlexDeMoConfig(fault_tolerance="torchft")) is node  # the same settings
    # the optimizer's own settings are not the node's: a Trainer's config and the launcher's may differ there
    assert replicas.node_replicas(FlexDeMoConfig(fault_tolerance="torchft", weight_decay=0.1)) is node
    assert set(replicas.NODE_SETTINGS) <= set(FlexDeMoConfig.field_names())
    with pytest.raises(ValueError, match=r"other settings: replay_steps=8 \(the node has 32\)"):
        replicas.node_replicas(FlexDeMoConfig(fault_tolerance="torchft", replay_steps=8))
