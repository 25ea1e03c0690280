"""What every replica must share: the description, its digest, and how a difference is named.

The collective half runs in tests/test_core_distributed.py (nodes launched with different settings).
"""

from __future__ import annotations

import pytest
import torch

from hf_flexdemo import FlexDeMo
from hf_flexdemo.agreement import LOCAL_SETTINGS, check_replicas_agree, differences, digest, group_settings
from hf_flexdemo.fault_tolerance.healing import Healing
from hf_flexdemo.fault_tolerance.node import FaultToleranceError, NodeIdentity
from hf_flexdemo.fault_tolerance.timeline import RoundClock
from hf_flexdemo.topology import ReplicaTopology

pytestmark = [pytest.mark.unit, pytest.mark.lowest]


def described(**settings) -> dict:
    return {"settings": {"topk": 32, "index_coding": "fixed", **settings}, "groups": [{"lr": 1e-3}, {"lr": 1e-3}]}


def test_a_difference_is_named_to_the_setting_and_the_group():
    theirs = described(index_coding="elias_fano")
    theirs["groups"][1]["lr"] = 2e-3
    assert differences(described(), theirs, "node 0", "node 1") == [
        "groups.1.lr: node 1 has 0.002, node 0 0.001",
        "settings.index_coding: node 1 has 'elias_fano', node 0 'fixed'",
    ]
    assert differences(described(), described(), "node 0", "node 1") == []
    shapes = {"parameter_shapes": [(4096, 4096)] * 1000}
    (line,) = differences(shapes, {"parameter_shapes": [(4096, 4096)] * 999}, "node 0", "node 1")
    assert len(line) < 500 and " ... " in line  # a large model's shapes are cut, not printed whole


def test_the_digest_changes_with_any_value_and_not_with_key_order():
    assert digest(described()) == digest({"groups": described()["groups"], "settings": described()["settings"]})
    assert digest(described()) != digest(described(topk=33))
    assert digest(described()) != digest(described(index_coding="elias_fano"))
    assert -(2**63) <= digest(described()) < 2**63  # fits the int64 tensor the replicas gather


def test_the_optimizer_describes_its_wire_and_groups_but_not_each_nodes_own_timeouts():
    model = torch.nn.Linear(8, 4)
    opt = FlexDeMo(model.parameters(), lr=3e-3, topk=4, chunk=4, value_bits=2, pack_indices=True, elementwise=[])
    description = opt.describe_replica()
    assert description["settings"]["value_bits"] == 2 and description["settings"]["index_coding"] == "fixed"
    assert not set(LOCAL_SETTINGS) & set(description["settings"])
    assert description["parameter_shapes"] == [(4, 8), (4,)]
    opt.param_groups[0]["lr"] = torch.tensor(5e-3)  # a scheduler may set a tensor: compared as a number
    assert group_settings(opt.param_groups)[0]["lr"] == pytest.approx(5e-3)
    check_replicas_agree(description, ReplicaTopology.single())  # one replica: nothing to compare, no collective


class FakeManager:
    def __init__(self):
        self.fns = {}

    def register_state_dict_fn(self, key, load, state):
        self.fns[key] = (load, state)


def test_a_torchft_node_with_other_settings_stops_before_loading_a_peers_state():
    manager = FakeManager()
    healing = Healing(manager, NodeIdentity("http://localhost:1", 1, 2), 0, RoundClock())
    healing.describe("flexdemo", lambda: described())
    (load, state), = manager.fns.values()
    peer = {"flexdemo": described(index_coding="elias_fano"), "node": "node 0"}
    with pytest.raises(FaultToleranceError, match="flexdemo.settings.index_coding: node 0 has 'elias_fano', this node"):
        load(peer)
    load(state() | {"node": "node 0"})  # the same description: taken
