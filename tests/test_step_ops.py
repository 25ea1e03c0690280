"""A step's work grows with its buckets, not its tensors: operations counted on CPU (a GPU launch each).

The counts come from ``benchmarks/step_ops.py`` (``torch.profiler``), on OLMo2's layout at a small
width; BENCHMARKS.md lists them at 16 layers. Counts, not times: they do not depend on the machine.
"""

from __future__ import annotations

import sys

import pytest
import torch
from support.launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from step_ops import CONFIGS, flexdemo_step_counts, olmo2_shapes, summarize  # noqa: E402

pytestmark = pytest.mark.unit

BUDGET = {"sign": 2_500, "default": 3_500}
"""Leaf operations per step at OLMo2's 16 layers (issue 24's targets; 21,320 and 32,868 before buckets)."""


@pytest.mark.parametrize("config", ["sign", "default", "default top24 2-bit"])
def test_kernel_launches_per_step_do_not_grow_with_the_number_of_layers(config):
    counts = {}
    for layers in (2, 6):
        shapes, vocab = olmo2_shapes(layers, hidden=32)
        counts[layers] = summarize(flexdemo_step_counts(shapes, vocab, CONFIGS[config]))
    assert counts[2]["launches"] == counts[6]["launches"], counts
    assert counts[6]["host syncs"] == 0, counts
    # Views (no kernel) may grow: one per tensor, to hand each parameter its part of a bucket's step.
    tensors = len(olmo2_shapes(6, hidden=32)[0]) - len(olmo2_shapes(2, hidden=32)[0])
    assert counts[6]["leaf ops"] - counts[2]["leaf ops"] <= tensors, counts


@pytest.mark.parametrize("config", sorted(BUDGET))
def test_a_step_on_olmo2s_16_layers_stays_within_its_operation_budget(config):
    shapes, vocab = olmo2_shapes(16, hidden=32)
    assert len(shapes) == 179
    figures = summarize(flexdemo_step_counts(shapes, vocab, CONFIGS[config]))
    assert figures["leaf ops"] <= BUDGET[config], figures


def test_the_count_sees_per_tensor_work():
    """The counter itself: a loop over tensors shows up, a _foreach_ over them counts once."""
    from step_ops import step_op_counts

    tensors = [torch.randn(4) for _ in range(10)]
    looped = step_op_counts(lambda: [t.add_(t) for t in tensors])
    fused = step_op_counts(lambda: torch._foreach_add_(tensors, tensors))
    assert sum(looped["launch"].values()) == 10 and sum(fused["launch"].values()) == 1
