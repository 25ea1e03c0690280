"""Bytes a step reads and writes per parameter, counted on CPU by ``benchmarks/step/step_traffic.py``'s dispatch mode.

The counter is checked on hand-made operations and on fused AdamW, whose traffic is known; then the
torch path of ``update="sign"`` is held to a budget, and the fused path (``kernels="triton"``) of ``sign``
and of the default rule (outside Newton-Schulz) to their targets. Bytes per parameter hardly depend on the
layout (OLMo2 at 2 layers, width 128 here; BENCHMARKS.md lists 16 layers at width 256), except at the
smallest widths for the fused path.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: the fused path's kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from support.launch import REPO_ROOT  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "step"))

from step_traffic import (  # noqa: E402
    CONFIGS,
    NS_BUCKET,
    TARGETS,
    StepTraffic,
    olmo2_shapes,
    steady_step_traffic,
    unavailable,
)

pytestmark = pytest.mark.unit

SIGN_BF16_BUDGET = 140.0
"""Bytes per bf16 parameter of ``update="sign"``'s torch path: 133.3 measured at 2 layers, width 128, plus 5%.
The fused path's target is 18 (``step_traffic.TARGETS``)."""


@pytest.fixture(scope="module")
def small_olmo2():
    return olmo2_shapes(2, 128)


def count(run) -> StepTraffic:
    with StepTraffic() as mode:
        run()
    return mode


def test_the_count_reads_and_writes_as_the_rule_says():
    a, b, c = torch.ones(100), torch.ones(100), torch.ones(100)  # 400 bytes each
    assert count(lambda: a.add_(b)).read["step"] == 800 and count(lambda: a.add_(b)).written["step"] == 400
    assert count(lambda: torch.add(a, b, out=c)).read["step"] == 800  # out= is written, not read
    assert count(lambda: c.copy_(a)).total() == 800  # read a, write c: copy_ does not read its destination
    assert count(lambda: a + b).total() == 1200
    assert count(lambda: a.to(torch.bfloat16)).total() == 600  # _to_copy: 400 read, 200 written
    assert count(lambda: (a.view(10, 10).t(), a.detach(), a[::2], torch.empty(50))).total() == 0
    assert count(lambda: a[::2].clone()).total() == 400  # a view counts its own extent: 200 read, 200 written
    lists = count(lambda: torch._foreach_mul_([a, b], 2.0))  # tensors inside lists count
    assert (lists.read["step"], lists.written["step"]) == (800, 800)


def test_a_custom_op_counts_as_one_op_with_its_real_inputs_and_outputs():
    @torch.library.custom_op("step_traffic_test::axpy_", mutates_args=("y",))
    def axpy_(x: torch.Tensor, y: torch.Tensor) -> None:
        y.add_(x * 2)  # a temporary inside: not counted

    x, y = torch.ones(100), torch.ones(100)
    mode = count(lambda: axpy_(x, y))
    assert (mode.read["step"], mode.written["step"]) == (800, 400)
    assert list(mode.by_op["step"]) == ["step_traffic_test.axpy_.default"]


@pytest.mark.parametrize("dtype, per_param", [(torch.bfloat16, 16.0), (torch.float32, 32.0)])
def test_fused_adamw_counts_its_four_tensors_read_and_written(small_olmo2, dtype, per_param):
    # Parameter, gradient and both moments in the parameter dtype: read 4, write 4. The gradient is written
    # because _fused_adamw_'s schema marks it mutated (Tensor(b!)[] grads).
    mode, numel = steady_step_traffic("fused AdamW", *small_olmo2, dtype)
    assert mode.read["step"] / numel == pytest.approx(per_param / 2, abs=1e-3)  # plus the step counters
    assert mode.total() / numel == pytest.approx(per_param, abs=1e-3)


def test_sign_update_torch_path_stays_within_its_traffic_budget(small_olmo2):
    mode, numel = steady_step_traffic("sign", *small_olmo2, torch.bfloat16)
    assert mode.total(NS_BUCKET) == 0
    assert mode.total() / numel <= SIGN_BF16_BUDGET


def test_newton_schulz_goes_to_its_own_bucket(small_olmo2):
    mode, numel = steady_step_traffic("default", *small_olmo2, torch.bfloat16)
    assert 0 < mode.total(NS_BUCKET) < mode.total()
    assert "aten.baddbmm.default" in mode.by_op[NS_BUCKET]
    assert "aten.baddbmm.default" not in mode.by_op["step"]


@pytest.mark.skipif("sign, fused" not in CONFIGS, reason="this FlexDeMo has no fused path (setting kernels)")
def test_the_fused_sign_path_meets_its_traffic_target():
    if unavailable("sign, fused"):
        pytest.skip(unavailable("sign, fused"))
    # A small layout (Triton's interpreter is slow): 15.2 bytes per parameter here (23.2 before weight decay was
    # folded into the decode and the gradients were read unstacked).
    shapes, vocab = olmo2_shapes(1, 128, vocab=128)
    mode, numel = steady_step_traffic("sign, fused", shapes, vocab, torch.bfloat16)
    assert mode.total() / numel <= TARGETS["sign"]


@pytest.mark.skipif("default, fused" not in CONFIGS, reason="this FlexDeMo has no fused path (setting kernels)")
def test_the_fused_default_rule_meets_its_traffic_target_outside_newton_schulz():
    if unavailable("default, fused"):
        pytest.skip(unavailable("default, fused"))
    # The same small layout as the sign path's (22.5 here); the embedding and head (adam) hold a larger share of it
    # than of 16 layers of width 256, whose figure BENCHMARKS.md lists.
    shapes, vocab = olmo2_shapes(1, 128, vocab=128)
    mode, numel = steady_step_traffic("default, fused", shapes, vocab, torch.bfloat16)
    assert (mode.total() - mode.total(NS_BUCKET)) / numel <= TARGETS["default outside NS"]
