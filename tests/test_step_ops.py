"""A step's work grows with its buckets, not its tensors: operations counted on CPU (a GPU launch each).

The counts come from ``benchmarks/step/step_ops.py`` (``torch.profiler``), on OLMo2's layout at a small
width; BENCHMARKS.md lists them at 16 layers. Counts, not times: they do not depend on the machine.
"""

from __future__ import annotations

import sys

import pytest
import torch
from support.launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "step"))

from step_ops import CONFIGS, flexdemo_step_counts, olmo2_shapes, summarize  # noqa: E402

pytestmark = pytest.mark.unit

BUDGET = {"sign": 2_500, "default": 3_500}
"""Leaf operations per step at OLMo2's 16 layers (issue 24's targets; 21,320 and 32,868 before buckets)."""


NEWTON_SCHULZ_ARITHMETIC = {
    "bf16": torch.bfloat16,  # what ns_dtype='auto' takes on a GPU or a CPU with oneDNN's bf16 path
    "float32": torch.float32,  # what it takes on a CPU with AVX2 only
    # float16 products on this CPU loop over the batch in torch's CPU kernel, as bf16 ones do on a CPU with AVX2
    # only (issue 34: there the counts grew with the layers): what the count must not see.
    "looping CPU kernel": torch.float16,
}


@pytest.fixture(params=sorted(NEWTON_SCHULZ_ARITHMETIC))
def newton_schulz_arithmetic(request, monkeypatch):
    """Each dtype the default rule's Newton-Schulz may run in, whatever this CPU would pick."""
    from hf_flexdemo.updates import orthogonal

    dtype = NEWTON_SCHULZ_ARITHMETIC[request.param]
    monkeypatch.setattr(orthogonal, "newton_schulz_dtype", lambda setting, device: dtype)
    return request.param


@pytest.mark.parametrize("config", ["sign", "default", "default top24 2-bit"])
def test_kernel_launches_per_step_do_not_grow_with_the_number_of_layers(config, newton_schulz_arithmetic):
    if config == "sign" and newton_schulz_arithmetic != "bf16":
        pytest.skip("update=sign runs no Newton-Schulz")
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
def test_a_step_on_olmo2s_16_layers_stays_within_its_operation_budget(config, newton_schulz_arithmetic):
    if config == "sign" and newton_schulz_arithmetic != "bf16":
        pytest.skip("update=sign runs no Newton-Schulz")
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


def test_a_batched_product_is_one_kernel_whatever_the_cpu_kernel_does_beneath():
    """An integer bmm loops over the batch underneath on every CPU (as float16 and bf16 do on CPUs without units for
    them; a CPU with AVX-512 FP16 or AMX runs those as one call, so they cannot show it everywhere): still one."""
    from step_ops import step_op_counts
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.ones(8, 16, 16, dtype=torch.int64), torch.ones(8, 16, 16, dtype=torch.int64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.bmm(a, b)
    assert sum(e.name == "aten::as_strided" for e in prof.events()) >= 8  # the loop the count must not see
    counts = step_op_counts(lambda: torch.bmm(a, b))
    assert counts["launch"] == {"aten::bmm": 1} and counts["leaf"] == {"aten::bmm": 1}


def test_the_default_rule_takes_newton_schulzs_dtype_from_the_device_policy(newton_schulz_arithmetic, monkeypatch):
    """The fixture above reaches the rule: a step iterates in the dtype forced."""
    from step_ops import CONFIGS, FlexDeMo

    from hf_flexdemo.updates import orthogonal

    seen, iterate = [], orthogonal.newton_schulz
    monkeypatch.setattr(orthogonal, "newton_schulz", lambda m, **kw: seen.append(kw["dtype"]) or iterate(m, **kw))
    params = [torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(16))]
    opt = FlexDeMo(params, lr=1e-3, elementwise=[], **CONFIGS["default"])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert seen == [NEWTON_SCHULZ_ARITHMETIC[newton_schulz_arithmetic]]
