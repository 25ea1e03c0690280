"""FlexDeMo on 2 simulated nodes x 2 processes (FSDP2 inside a node, gloo on CPU).

One torchrun start-up runs every check (tests/workers/core_worker.py); the tests below
assert on what each rank measured.
"""

from __future__ import annotations

import pytest
from support.launch import TESTS_DIR, read_rank_results, torchrun

pytestmark = pytest.mark.multiprocess

SYNCING = ("demo", "random", "striding", "full", "diloco", "sparseloco")
SYNCING += ("demo_1bit_packed", "demo_4bit", "demo_2bit_stochastic", "sparseloco_2bit_packed")
SYNCING += ("demo_2bit_elias_fano", "sparseloco_ortho")
UPDATE_RULES = ("demo_adam", "full_adam", "demo_ortho_adam")
SYNCING += UPDATE_RULES
ALL = (*SYNCING, "none")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("core")
    torchrun(TESTS_DIR / "workers" / "core_worker.py", 4, str(out))
    return read_rank_results(out, 4)


@pytest.mark.parametrize("scheme", SYNCING)
def test_replicas_bitwise_identical_after_20_steps(ranks, scheme):
    for rank in ranks:
        assert rank["schemes"][scheme]["replicas_equal"], f"rank {rank['rank']}: replicas differ after {scheme}"
        assert rank["schemes"][scheme]["should_match"]


def test_scheme_none_lets_replicas_drift_and_reports_it(ranks):
    for rank in ranks:
        assert not rank["schemes"]["none"]["replicas_equal"]
        assert not rank["schemes"]["none"]["should_match"]


@pytest.mark.parametrize("scheme", ALL)
def test_each_scheme_lowers_the_loss(ranks, scheme):
    first = sum(sum(r["schemes"][scheme]["losses"][:4]) for r in ranks) / (4 * len(ranks))
    last = sum(sum(r["schemes"][scheme]["losses"][-4:]) for r in ranks) / (4 * len(ranks))
    assert last < 0.9 * first, f"{scheme}: loss {first:.4f} -> {last:.4f}"


@pytest.mark.parametrize("scheme", ALL)
def test_counters_equal_the_bytes_put_on_the_wire(ranks, scheme):
    for rank in ranks:
        steps = rank["schemes"][scheme]["per_step"]
        # Step 1 also carries the one-off start checks (an 8-byte settings digest and an 8-byte fingerprint per
        # replica), and with ns_dtype='auto' the replicas' agreement on Newton-Schulz's dtype (an 8-byte flag).
        start = 8 + 8 + (8 if rank["schemes"][scheme]["ns_dtype_agreed"] else 0)
        assert steps[0]["wire"] == steps[0]["counted"] + start
        for i, step in enumerate(steps[1:], start=2):
            assert step["counted"] == step["wire"], f"rank {rank['rank']} step {i}"
        assert rank["schemes"][scheme]["total_sent"] == sum(s["counted"] for s in steps)


def test_one_packed_collective_per_replication_step(ranks):
    for rank in ranks:
        s = rank["schemes"]
        for scheme in ("demo", "random", "striding", "full", *UPDATE_RULES):
            assert [step["collectives"] for step in s[scheme]["per_step"][1:]] == [1] * 19
        for scheme in ("diloco", "sparseloco", "sparseloco_ortho"):
            assert [step["collectives"] for step in s[scheme]["per_step"][1:]] == [
                1 if i % 5 == 0 else 0 for i in range(2, 21)
            ]
        assert [step["collectives"] for step in s["none"]["per_step"][1:]] == [0] * 19


def test_the_orthogonal_rule_moves_matrices_to_their_owners_and_back_inside_the_node(ranks):
    """Two all-to-alls over the node's own processes per step; never one across nodes."""
    for rank in ranks:
        s = rank["schemes"]
        # The default rule, and Muon's inner step between outer steps (every step, outer or not)
        ortho = ("demo", "full", "none", "demo_ortho_adam", "sparseloco_ortho")
        for scheme in ortho:
            assert [step["node_all_to_alls"] for step in s[scheme]["per_step"]] == [2] * 20, scheme
        for scheme in ("random", "striding", "diloco", "demo_adam"):
            assert all(step["node_all_to_alls"] == 0 for step in s[scheme]["per_step"]), scheme


def test_dense_all_reduce_counterfactual_and_compression(ranks):
    for rank in ranks:
        for scheme in ALL:
            result = rank["schemes"][scheme]
            # Two replicas: a ring all-reduce sends exactly the gradient's bytes (bf16: 2 per parameter), every step.
            assert result["total_dense"] == result["dense_expected"]
        s = rank["schemes"]
        # scheme='full' all-reduces these fp32 gradients: twice the bf16 baseline.
        assert s["demo"]["total_sent"] < s["full"]["total_sent"] == 2 * s["full"]["total_dense"]
        assert s["diloco"]["total_sent"] * 5 == s["full"]["total_sent"]
        # Top 4 of 8x8 tiles at 2 bits with packed indices; these odd shapes have many thin tiles.
        assert s["sparseloco_2bit_packed"]["total_sent"] * 2 < s["sparseloco"]["total_sent"] < s["diloco"]["total_sent"]


@pytest.mark.parametrize(
    "config",
    [
        "demo",
        "demo_sign",
        "demo_packed",
        "demo_elias_fano",
        "demo_every2",
        "random",
        "striding",
        "full",
        "none",
        "diloco",
    ]
    + ["demo_adam", "full_adam", "full_ortho", "demo_ortho_adam", "diloco_ortho"],
)
def test_sharded_replicas_match_the_one_process_reference(ranks, config):
    # Orthogonal: Newton-Schulz runs in float32 on both sides (on the whole matrix, gathered inside the node),
    # here as a batched product with fused additions, there as a plain one. The iterates differ by float32
    # ulps, which the iteration's growth of small singular values amplifies: 8 steps of lr 0.05 stay under 1e-5.
    tolerance = 1e-5 if "ortho" in config else 1e-12
    for rank in ranks:
        result = rank["oracle"][config]
        assert result["max_abs_err"] <= tolerance * max(1.0, result["scale"]), result
        # Momentum, or DiLoCo's Adam moment and anchor: the anchor is the parameters at an outer step, so with
        # Muon's inner step it carries their Newton-Schulz rounding.
        state_tolerance = tolerance * max(1.0, result["scale"]) if config == "diloco_ortho" else 1e-12
        assert result["state_err"] <= state_tolerance, result


@pytest.mark.parametrize(
    "scheme",
    ["demo", "random", "diloco", "sparseloco", "demo_overlap", "demo_adam", "demo_ortho"]
    + ["demo_eliasfano", "sparseloco_ortho"],
)
def test_checkpoint_restores_every_replicas_own_state(ranks, scheme):
    for rank in ranks:
        result = rank["checkpoint"][scheme]
        assert result["state_differs_across_replicas"], "test is void: replicas hold the same state"
        assert result == {k: True for k in result}, result


def test_overlap_applies_the_same_updates_one_step_late(ranks):
    for rank in ranks:
        result = rank["overlap"]
        assert result["equal_to_plain"]
        assert result["overlap=True"]["pending_before_flush"] and not result["overlap=False"]["pending_before_flush"]
        for mode in ("overlap=False", "overlap=True"):
            assert result[mode]["replicas_equal"]
            # The wire also carries the one-off start checks (a settings digest and a fingerprint, 8 bytes each)
            # besides the counted exchange, and the default rule's agreement on ns_dtype='auto' (8 bytes).
            assert result[mode]["wire"] == result[mode]["counted"] + 8 + 8 + 8


def test_a_drifting_replica_is_caught(ranks):
    for rank in ranks:
        # Replica 1 changed one entry of its shard, so both replicas of each shard see it.
        message = rank["drift"]["raised"]
        assert message and "replicas hold different parameters at step 4" in message, rank["drift"]


def test_hsdp_parameters_are_refused(ranks):
    for rank in ranks:
        message = rank["errors"]["hsdp"]
        assert message and "HSDP" in message and "fully_shard" in message


def test_multi_process_job_without_mesh_is_refused(ranks):
    for rank in ranks:
        message = rank["errors"]["no_mesh"]
        assert message and "no inter-node group" in message and "attach" in message


def test_replicas_start_from_replica_zero(ranks):
    for rank in ranks:
        assert rank["start_sync"] == {"differed_before": True, "equal_after": True}


def test_nodes_with_different_settings_are_refused_before_the_exchange(ranks):
    for rank in ranks:
        cases = rank["settings"]
        assert cases["same"] == {"raised": None, "stepped": True}
        for name, node0, node1 in (("index_coding", "'fixed'", "'elias_fano'"), ("lr", "0.001", "0.002")):
            message, key = cases[name]["raised"], "settings.index_coding" if name == "index_coding" else "groups.0.lr"
            assert message and "launched with different settings" in message, cases
            assert f"{key}: node 1 has {node1}, node 0 {node0}" in message, message
            assert "the same --optim_args" in message
            assert not cases[name]["stepped"]


def test_ns_dtype_auto_takes_one_dtype_for_the_whole_job(ranks):
    """bf16 only where every process multiplies it fast: a node without bf16 units puts the job on float32."""
    for rank in ranks:
        assert rank["ns_dtype"] == {
            "all_fast": "torch.bfloat16",
            "node1_slow": "torch.float32",
            "node1_slow_forced": "torch.bfloat16",  # an explicit ns_dtype is the user's choice, on every node
            "rule_dtype": "torch.float32",
            "replicas_equal": True,
        }


def test_triton_kernels_keep_replicas_bitwise_identical_and_the_wire_unchanged(ranks):
    """kernels='triton' on FSDP2 shards (2 nodes x 2 processes, Triton's interpreter): replicas stay bitwise equal,
    the same bytes cross nodes as with kernels='torch', and the parameters follow the torch path's."""
    if ranks[0]["triton"] is None:
        pytest.skip("Triton is not installed (pip install triton)")
    for rank in ranks:
        fused, plain = rank["triton"]["triton"], rank["triton"]["torch"]
        assert fused["replicas_equal"] and plain["replicas_equal"]
        assert fused["wire"] == plain["wire"] and fused["counted"] == plain["counted"]
        for got, expected in zip(fused["params"], plain["params"]):
            differ = sum(abs(a - b) > 1e-6 for a, b in zip(got, expected))
            assert differ <= max(1, len(expected) // 100), f"rank {rank['rank']}: {differ} of {len(expected)} differ"
