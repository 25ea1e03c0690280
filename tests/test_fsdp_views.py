"""FSDP2 blocks that return view tensors (T5's first block returns its position bias).

torch warns that an in-place op on such a view drops FSDP2's backward all-gather of the
block. One `accelerate launch` (1 node x 2 processes) of tests/workers/fsdp_views_worker.py
compares gradients under the project's wrapping with the same model unwrapped: tiny T5, and a
model that does add in place to its blocks' outputs.
"""

from __future__ import annotations

import json

import pytest
from support.accelerate_runs import launch_command
from support.launch import TESTS_DIR, child_env, run_checked

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("views")
    cmd = launch_command(str(TESTS_DIR / "workers" / "fsdp_views_worker.py"), config="cpu_1x2.yaml")
    cmd.append(str(out))
    run_checked(cmd, timeout=300, env=child_env())
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", ["t5", "in_place"])
def test_gradients_equal_the_unwrapped_models(ranks, case):
    for rank in ranks:
        result = rank[case]
        assert result["error"] is None, result
        assert not result["missing"] and result["compared"] > 0, result
        assert result["max_diff"] < 1e-5, result


@pytest.mark.parametrize("case", ["t5", "in_place"])
def test_no_block_returns_a_view(ranks, case):
    assert all(rank[case]["view_warnings"] == 0 for rank in ranks), [rank[case] for rank in ranks]
