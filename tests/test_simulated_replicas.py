"""``simulate_replicas=R``: one process trains R replicas bitwise as R gloo nodes do, fed the same micro-batches.

One torchrun per R (tests/workers/simulation_worker.py) trains every configuration as R nodes of one process;
the simulation runs here, in this process, through the same training function.
"""

from __future__ import annotations

import pytest
import torch
from support.launch import TESTS_DIR, torchrun
from workers.simulation_worker import CONFIGS, adamw, train

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[2, 3], ids=lambda r: f"R{r}")
def nodes(request, tmp_path_factory):
    replicas = request.param
    out = tmp_path_factory.mktemp(f"nodes{replicas}")
    torchrun(TESTS_DIR / "workers" / "simulation_worker.py", replicas, str(out))
    return replicas, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(replicas)]


@pytest.fixture(autouse=True)
def one_thread():
    """The nodes run one thread each: matrix products then sum in the same order here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CONFIGS)
def test_simulation_is_bitwise_the_nodes(nodes, name):
    replicas, ranks = nodes
    simulated = train(name, replicas, rank=None)
    for rank, node in enumerate(ranks):
        for i, (mine, theirs) in enumerate(zip(simulated["params"], node[name]["params"])):
            assert torch.equal(mine, theirs), f"{name}: parameter {i} differs from node {rank}'s"
    compared = 0
    for i, state in enumerate(simulated["state"]):
        param_shape = simulated["params"][i].shape
        for key, value in state.items():
            if not value.is_floating_point():
                continue  # step counts, tile sizes, byte counters
            for rank, node in enumerate(ranks):
                theirs = node[name]["state"][i][key]
                if value.shape == (replicas, *param_shape) and theirs.shape == (1, *param_shape):  # per replica
                    assert torch.equal(value[rank], theirs[0]), f"{name}: {key} of parameter {i}, replica {rank}"
                else:  # the same on every replica (the rules' state)
                    assert torch.equal(value, theirs), f"{name}: {key} of parameter {i} against node {rank}"
                compared += 1
    assert compared, "no floating state compared"
    assert simulated["bytes_sent"] == ranks[0][name]["bytes_sent"] > 0


def test_adamw_on_the_accumulated_micro_batches_is_adamw_hsdp(nodes):
    replicas, ranks = nodes
    for mine, theirs in zip(adamw(replicas, rank=None), ranks[0]["adamw"]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_simulation_inside_a_real_replicate_group_is_refused(nodes):
    replicas, ranks = nodes
    for node in ranks:
        assert f"also has a real replicate group of {replicas} nodes. Use one or the other" in node["refused"]
