"""Fused kernels (hf_flexdemo.kernels) against the torch functions they must equal, on CPU under Triton's interpreter.

``FLEXDEMO_KERNEL_TEST_DEVICE=cuda`` runs the same checks compiled, on a GPU (both paths on the GPU's tensors):
``benchmarks/gpu_session.sh`` does so where a GPU is lent.

Tolerances, and why: both paths compute in float32 and differ only in summation order (the DCT's products, the
decode's low-rank product against a dense inverse DCT, a 1-bit scale's mean). Coefficients and momenta therefore
agree to ``rtol=1e-5`` with ``atol=1e-6 * max|Q|`` (a sum of at most 64 x 64 products, each rounded at 2**-24
relative, lands well inside; on a GPU with TF32 the kernels multiply in three TF32 products, ``dot_precision``,
which passed at these tolerances on an H200); selections are identical on tie-free data; codes are identical (a
value would have to sit within float32 rounding of a rounding boundary to differ). A parameter moved by the sign
rule is bitwise equal, except where the decoded update is zero in exact arithmetic, where its sign is rounding noise
in both paths (checked: only where ``|U| <= 1e-5 * max|U|``). ``lr`` is a power of two, so torch's CPU add, which
rounds ``lr`` to bf16 for bf16 parameters, agrees with the kernel's float32 arithmetic.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

DEVICE = os.environ.get("FLEXDEMO_KERNEL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: kernels then run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_flexdemo import FlexDeMo, FlexDeMoConfig  # noqa: E402
from hf_flexdemo.compression import ChunkPlan, decode_replicas, flat_positions, from_coefficients, select_topk  # noqa
from hf_flexdemo.kernels.demo_encode_torch import demo_encode_torch  # noqa: E402
from hf_flexdemo.kernels.sign_decode_torch import sign_decode_torch  # noqa: E402
from hf_flexdemo.schemes.sparse_wire import TopKWire  # noqa: E402

pytestmark = pytest.mark.unit
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)"
)
LR = 2**-7  # exact in bf16 (see the module docstring)


def _interpreter_rounds_fma_twice() -> bool:
    """Triton's interpreter before 3.9 evaluates ``tl.fma(a, b, c)`` as numpy's ``a * b + c``: two float32 roundings
    (``create_fma`` in ``triton/runtime/interpreter.py``), where torch's CPU add and a GPU's fma round once. Torch
    2.14's wheels pin Triton 3.8."""
    if DEVICE != "cpu" or importlib.util.find_spec("triton") is None:
        return False
    import triton
    from packaging.version import Version

    return Version(triton.__version__).release < (3, 9)


FMA_ROUNDS_TWICE = _interpreter_rounds_fma_twice()
DECAY = 1 - 2**-8
"""Weight decay's factor in the tests: one bf16 and fp16 hold exactly, since torch's CPU multiply rounds the
factor to the dtype of 16-bit parameters, where CUDA's and the kernels keep it in float32 (as ``lr``)."""

# (one parameter's shape, parameters in the bucket, chunk, topk): tile sides 64 x 48, 7 x 7, 1 x 4 (a prime
# dimension above chunk), 1-D (one row of 40), and a tile of 5 x 13 nearly sent whole.
CASES = {
    "64x48": ((64, 48), 1, 64, 32),
    "7x7": ((7, 14), 3, 7, 5),
    "side1": ((11, 4), 1, 8, 3),
    "1d": ((40,), 3, 64, 6),
    "5x13": ((5, 13), 3, 64, 60),
}
FORMATS = {  # value_bits, wire dtype, stochastic rounding
    "fp32": (0, torch.float32, False),
    "bf16": (0, torch.bfloat16, False),
    "fp16": (0, torch.float16, False),
    "1bit": (1, torch.float32, False),
    "2bit": (2, torch.float32, False),
    "4bit": (4, torch.float32, False),
    "8bit": (8, torch.float32, False),
    "2bit_stochastic": (2, torch.float32, True),
    "8bit_stochastic": (8, torch.float32, True),
}


def bucket_plan(case: str) -> tuple[ChunkPlan, tuple[int, ...]]:
    shape, count, chunk, topk = CASES[case]
    return ChunkPlan.for_shape(shape, chunk, topk).stacked(count), (count, *shape)


def encode_both(case: str, fmt: str, grad_dtype=torch.float32, seed: int = 0, unstacked: bool = False):
    """The torch function and the kernel on the same inputs: ``(torch result, kernel result, q torch, q kernel)``.
    ``unstacked``: the kernel reads each parameter's gradient from its own tensor, as the optimizer hands them."""
    from hf_flexdemo.kernels.demo_encode import demo_encode

    plan, shape = bucket_plan(case)
    bits, wire, stochastic = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(shape, generator=g).to(DEVICE, grad_dtype)
    q = torch.randn(plan.rows, plan.cols, generator=g).to(DEVICE)
    noise = torch.rand(plan.n_tiles, plan.k, generator=g).to(DEVICE) if stochastic else None
    q_torch, q_kernel = q.clone(), q.clone()
    settings = dict(decay=0.9, lr=0.5, select=True, bits=bits, wire_dtype=wire, noise=noise)
    expected = demo_encode_torch(grad, q_torch, plan, **settings)
    got = demo_encode([g.clone() for g in grad] if unstacked else grad, q_kernel, plan, **settings)
    return plan, expected, got, q_torch, q_kernel


def assert_close_f32(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | float) -> None:
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-5, atol=1e-6 * float(scale))


def assert_encode_agrees(plan, expected, got, q_torch, q_kernel) -> None:
    scale = max(q_torch.abs().max(), expected.values.abs().max())  # the momentum's size before error feedback
    assert torch.equal(got.indices.long(), expected.indices), "the kernel selected other coefficients"
    assert_close_f32(got.values, expected.values, scale)
    assert_close_f32(q_kernel, q_torch, scale)
    if expected.codes is not None:
        assert torch.equal(got.codes.long(), expected.codes)
        torch.testing.assert_close(got.scale, expected.scale, rtol=1e-5, atol=0)
    else:
        assert got.codes is None and got.scale is None


# -- the torch path's order (no Triton needed) ------------------------------------------------------------------


def test_select_topk_gives_indices_ascending_within_each_tile():
    plan, _ = bucket_plan("7x7")
    coefficients = torch.randn(plan.rows, plan.cols, generator=torch.Generator().manual_seed(3))
    indices, values = select_topk(coefficients, plan)
    assert torch.equal(indices, indices.sort(dim=1).values)
    assert torch.equal(values.reshape(-1), coefficients.reshape(-1)[flat_positions(indices, plan)])


# -- encode ------------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_encode_kernel_equals_torch_on_every_tile_shape(case):
    grad_dtype = torch.bfloat16 if case in ("7x7", "1d") else torch.float32
    plan, expected, got, q_torch, q_kernel = encode_both(case, "fp32", grad_dtype)
    assert_encode_agrees(plan, expected, got, q_torch, q_kernel)
    # Error feedback with float32 on the wire leaves nothing of what was sent.
    assert not q_kernel.reshape(-1)[flat_positions(got.indices, plan)].any()


@needs_triton
@pytest.mark.parametrize("case", ["7x7", "1d", "5x13"])
def test_encode_kernel_reads_each_parameters_gradient_where_it_is(case):
    """Gradients in separate tensors (through a table of their addresses): the same as from their stack."""
    grad_dtype = torch.bfloat16 if case == "7x7" else torch.float32
    assert_encode_agrees(*encode_both(case, "2bit", grad_dtype, seed=2, unstacked=True))


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_kernel_equals_torch_in_every_wire_format(fmt):
    assert_encode_agrees(*encode_both("5x13" if fmt in ("1bit", "fp16") else "1d", fmt, seed=1))


@needs_triton
def test_encode_kernel_only_accumulates_between_replications():
    from hf_flexdemo.kernels.demo_encode import demo_encode

    plan, shape = bucket_plan("7x7")
    grad, q = torch.randn(shape, device=DEVICE), torch.randn(plan.rows, plan.cols, device=DEVICE)
    q_torch, q_kernel = q.clone(), q.clone()
    settings = dict(decay=0.9, lr=0.5, select=False, bits=0, wire_dtype=torch.float32)
    assert demo_encode_torch(grad, q_torch, plan, **settings) is None
    assert demo_encode(grad, q_kernel, plan, **settings) is None
    assert_close_f32(q_kernel, q_torch, q_torch.abs().max())


@needs_triton
def test_encode_kernel_breaks_exact_ties_by_the_lowest_index():
    """Exact ties at the k-th magnitude: the kernel takes the lowest indices; torch.topk takes equal values."""
    from hf_flexdemo.kernels.demo_encode import demo_encode

    plan = ChunkPlan.for_shape((4, 4), 4, 4)
    q = torch.tensor([[1.0, 3.0, -2.0, 0.5], [2.0, -0.5, 2.0, -2.0], [0.0, 1.0, 0.25, 2.0], [-3.0, 1.0, 0.0, 0.1]])
    q, grad = q.to(DEVICE), torch.zeros(4, 4, device=DEVICE)
    settings = dict(decay=1.0, lr=0.0, select=True, bits=0, wire_dtype=torch.float32)  # Q stays as it is
    got = demo_encode(grad, q.clone(), plan, **settings)
    # |Q| = 3 at 1 and 12, then the 2s at 2, 4, 6, 7, 11: the two of lowest index complete k = 4.
    assert got.indices.tolist() == [[1, 2, 4, 12]]
    assert got.values.tolist() == [[3.0, -2.0, 2.0, -3.0]]
    expected = demo_encode_torch(grad, q.clone(), plan, **settings)
    assert sorted(expected.values.abs().reshape(-1).tolist()) == [2.0, 2.0, 3.0, 3.0]


# -- decode and apply (sign rule) --------------------------------------------------------------------------------


def replica_parts(plan: ChunkPlan, replicas: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each replica's top-k of a shared signal plus its own: the replicas' positions overlap in part."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(plan.rows, plan.cols, generator=g)
    signals = [(shared + 0.7 * torch.randn(plan.rows, plan.cols, generator=g)).to(DEVICE) for _ in range(replicas)]
    return [select_topk(signal, plan) for signal in signals]


def decode_both(plan, shape, parts, *, mode, sign, dtype, decay=1.0):
    """The start (after weight decay's factor ``decay``), the torch path's result, the kernel's, the update."""
    from hf_flexdemo.kernels.sign_decode import sign_decode

    start = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    expected, got = list(start.clone().unbind(0)), list(start.clone().unbind(0))
    sign_decode_torch(expected, parts, plan, mode=mode, lr=LR, sign=sign, decay=decay)
    sign_decode(got, parts, plan, mode=mode, lr=LR, sign=sign, decay=decay)
    update = from_coefficients(decode_replicas(parts, plan, mode, torch.float32), plan).reshape(shape)
    return start.mul_(decay), torch.stack(expected), torch.stack(got), update


def assert_sign_steps_agree(start, expected, got, update) -> None:
    """Bitwise equal but where the decoded update is zero to float32 rounding (there, its sign is noise)."""
    differ = expected != got
    undecided = update.abs() <= 1e-5 * update.abs().max()
    assert not (differ & ~undecided).any(), f"{int((differ & ~undecided).sum())} entries moved differently"
    size = torch.maximum(start.float().abs(), expected.float().abs())
    rounding = size * (2**-8 if start.dtype == torch.bfloat16 else 2**-23)  # p - lr rounded to p's dtype
    assert ((expected.float() - start.float()).abs() <= LR + rounding).all()


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_sign_decode_kernel_equals_torch(case, replicas):
    plan, shape = bucket_plan(case)
    parts = replica_parts(plan, replicas, seed=replicas)
    mode = "mean" if case == "side1" else "selected"
    dtype = torch.bfloat16 if replicas == 2 else torch.float32
    decay = 1.0 if replicas == 1 else DECAY  # weight decay folded into the kernel's pass
    assert_sign_steps_agree(*decode_both(plan, shape, parts, mode=mode, sign=True, dtype=dtype, decay=decay))


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("replicas", [1, 3])
def test_dense_decode_kernel_equals_torch(case, replicas):
    """What the orthogonal and adam rules take: the decoded update itself, to float32 rounding (summation order)."""
    from hf_flexdemo.kernels.sign_decode import demo_decode
    from hf_flexdemo.kernels.sign_decode_torch import demo_decode_torch

    plan, _ = bucket_plan(case)
    parts = replica_parts(plan, replicas, seed=replicas)
    for mode in ("selected", "mean"):
        expected = demo_decode_torch(parts, plan, mode=mode)
        got = demo_decode(parts, plan, mode=mode)
        assert got.shape == expected.shape == (plan.rows, plan.cols) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["selected", "mean"])
def test_sign_false_decode_kernel_applies_the_update_itself(dtype, mode):
    plan, shape = bucket_plan("7x7")
    start, expected, got, update = decode_both(
        plan, shape, replica_parts(plan, 3), mode=mode, sign=False, dtype=dtype, decay=DECAY
    )
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6  # one unit of the parameter's last place, relative
    torch.testing.assert_close(got.float(), expected.float(), rtol=ulp, atol=1e-7)
    assert not torch.equal(got, start)


@needs_triton
@pytest.mark.parametrize(
    "settings",
    [
        dict(value_bits=0, pack_indices=True),
        dict(value_bits=1, pack_indices=True),
        dict(value_bits=2, rounding="stochastic"),
        dict(value_bits=4, pack_indices=True),
        dict(value_bits=2, pack_indices=True, index_coding="elias_fano"),
        dict(value_bits=8),
    ],
    ids=str,
)
def test_wire_round_trip_encoded_by_the_kernel_decodes_alike(settings):
    """Two replicas encode with the kernel, their parts cross the wire (packed, quantized) and are read back:
    the fused decode equals the torch one on what arrives."""
    from hf_flexdemo.kernels.demo_encode import demo_encode

    wire = TopKWire(FlexDeMoConfig(update="sign", **settings))
    plan, shape = bucket_plan("5x13")
    received = []
    for replica in range(2):
        g = torch.Generator().manual_seed(replica)
        q = torch.randn(plan.rows, plan.cols, generator=g)
        noise = wire.noise((plan.n_tiles, plan.k), q.device, g)
        q, noise, grad = q.to(DEVICE), noise.to(DEVICE) if noise is not None else None, torch.randn(shape, generator=g)
        encoded = demo_encode(
            grad.to(DEVICE), q, plan, decay=0.9, lr=0.5, select=True,
            bits=wire.config.value_bits, wire_dtype=torch.bfloat16, noise=noise,
        )  # fmt: skip
        received.append(wire.read(wire.pack(*encoded, plan, torch.bfloat16), plan))
    assert_sign_steps_agree(*decode_both(plan, shape, received, mode="selected", sign=True, dtype=torch.bfloat16))


# -- the rules' pass over the parameters (orthogonal, adam) ---------------------------------------------------

RULE_SHAPES = [(7, 5), (7, 5), (7, 5)]  # a bucket: same-shape parameters, 35 entries each (under one block)
BIG_SHAPES = [(33, 40), (33, 40)]  # 1,320 entries each: two programs per parameter, the second one masked


def rule_params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(DEVICE, dtype) for shape in shapes]


@needs_triton
@pytest.mark.parametrize("shapes", [RULE_SHAPES, BIG_SHAPES], ids=["small", "two_blocks"])
@pytest.mark.parametrize(
    "dtype, step_dtype, alpha, decay",
    [
        (torch.float32, torch.float32, -0.37, 1.0),
        (torch.float32, torch.bfloat16, -0.37, 0.99),  # any factor: float32 parameters
        (torch.bfloat16, torch.bfloat16, -(2**-5), 1.0),  # a power of two: torch's CPU add rounds alpha to bf16
        (torch.bfloat16, torch.float32, -(2**-5), DECAY),  # the step rounded to bf16 first, as the torch path
        (torch.float16, torch.float32, -(2**-5), DECAY),
    ],
)
def test_add_step_kernel_equals_torch(shapes, dtype, step_dtype, alpha, decay):
    """The orthogonal rule's subtraction, with weight decay's factor: bitwise the torch path's, also from a
    transposed (tall) step. Under Triton < 3.9's interpreter, whose fma rounds the product first
    (:func:`_interpreter_rounds_fma_twice`), within that one extra rounding: float32's half unit of the
    product ``alpha * step``, and one unit of the parameter's dtype where it tips the final rounding."""
    from hf_flexdemo.kernels.rule_step import add_step
    from hf_flexdemo.kernels.rule_step_torch import add_step_torch

    expected, got = rule_params(shapes, dtype), rule_params(shapes, dtype)
    rows, cols = shapes[0]
    step = torch.randn(len(shapes), cols, rows, generator=torch.Generator().manual_seed(1)).mT  # Newton-Schulz's
    step = step.to(DEVICE, step_dtype)
    add_step_torch(expected, step, alpha, decay)
    add_step(got, step, alpha, decay)
    for e, o, s in zip(expected, got, step.to(dtype).unbind(0)):
        if not FMA_ROUNDS_TWICE:
            assert torch.equal(o, e)
            continue
        product = (alpha * s.float()).abs()
        bound = torch.finfo(torch.float32).eps / 2 * product + torch.finfo(dtype).eps * e.float().abs()
        assert ((o.float() - e.float()).abs() <= bound).all()
    assert not torch.equal(got[0], rule_params(shapes, dtype)[0])


@needs_triton
@pytest.mark.parametrize("shapes", [RULE_SHAPES, BIG_SHAPES], ids=["small", "two_blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_step_kernel_equals_torch(shapes, dtype):
    """The adam rule: second moments to float32 rounding, parameters within one unit of their last place, over
    three steps of other counts per parameter (each its own bias correction)."""
    from hf_flexdemo.kernels.rule_step import adam_step
    from hf_flexdemo.kernels.rule_step_torch import adam_step_torch

    expected, got = rule_params(shapes, dtype), rule_params(shapes, dtype)
    g = torch.Generator().manual_seed(2)
    v_expected = torch.rand(len(shapes), *shapes[0], generator=g).to(DEVICE)
    v_got = v_expected.clone()
    counts = torch.arange(1, len(shapes) + 1, dtype=torch.float64, device=DEVICE)
    settings = dict(lr=2**-6, beta2=0.95, eps=1e-8)
    for _ in range(3):
        counts += 1
        correction = (1 - torch.pow(settings["beta2"], counts)).to(torch.float32)
        update = (torch.randn(len(shapes), *shapes[0], generator=g) * 2**-6).to(DEVICE)
        adam_step(got, update, v_got, correction, **settings, decay=DECAY)
        adam_step_torch(expected, update.clone(), v_expected, correction, **settings, decay=DECAY)
    torch.testing.assert_close(v_got, v_expected, rtol=1e-6, atol=0)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
    for e, o in zip(expected, got):
        torch.testing.assert_close(o.float(), e.float(), rtol=ulp, atol=1e-7)


# -- the optimizer -----------------------------------------------------------------------------------------------

SHAPES = [(16, 32), (16, 32), (7, 5), (40,), (3,)]


def run_optimizer(kernels: str, dtype: torch.dtype, steps: int = 5, **settings):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(DEVICE, dtype)) for shape in SHAPES]
    opt = FlexDeMo(params, lr=LR, weight_decay=0.1, topk=8, chunk=16, kernels=kernels, **settings)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(DEVICE, dtype)
        opt.step()
    momenta = torch.cat([opt.state[p]["momentum_dct"].reshape(-1) for p in params])
    return torch.cat([p.detach().float().reshape(-1) for p in params]), momenta


@needs_triton
@pytest.mark.parametrize(
    "dtype, settings",
    [
        (torch.float32, dict(update="sign")),
        (torch.bfloat16, dict(update="sign", replicate_every=2)),
        (torch.float32, dict(update="sign", value_bits=2, rounding="stochastic", pack_indices=True)),
        (torch.bfloat16, dict(update="sign", sign=False)),
        (torch.float32, dict(update="orthogonal", ns_dtype="float32", elementwise=[])),
        (torch.bfloat16, dict(ns_dtype="float32")),  # the default rule: orthogonal, adam for the 1-D parameters
        (torch.float32, dict(update="sign", scale_topk=True, value_bits=2, pack_indices=True)),  # k: 8, 1, 1, 1
    ],
    ids=[
        "sign-fp32",
        "sign-bf16-every2",
        "sign-2bit-stochastic",
        "sign_false-bf16",
        "orthogonal",
        "default-bf16",
        "sign-2bit-scaled",
    ],
)
def test_flexdemo_with_triton_kernels_follows_torch_over_five_steps(dtype, settings):
    """One process: the encode kernel under every rule, the sign rule's decode kernel; 5 steps.

    Momenta agree to float32 rounding. Parameters: the sign rule's steps agree bitwise but where a decoded entry is
    zero in exact arithmetic (2-bit values make exact cancellations common), at most 1% of them, by whole steps;
    the others to float32 rounding, amplified by Newton-Schulz for the orthogonal rule; with bf16 parameters, one
    unit of their last place a step, since torch's CPU add rounds the step's factor (``-lr * sqrt(max(rows,
    cols))``) to bf16 where the kernel keeps it in float32.
    """
    expected, expected_q = run_optimizer("torch", dtype, **settings)
    got, got_q = run_optimizer("triton", dtype, **settings)
    assert_close_f32(got_q, expected_q, expected_q.abs().max())
    if settings.get("update", "orthogonal") == "orthogonal" or not settings.get("sign", True):
        torch.testing.assert_close(got, expected, rtol=5 * 2**-7 if dtype == torch.bfloat16 else 1e-4, atol=1e-6)
        return
    differ = (got - expected).abs() > 1e-6
    assert differ.float().mean() <= 0.01
    assert ((got - expected).abs() <= 2 * LR * 5 + 1e-6).all()


# -- the setting -------------------------------------------------------------------------------------------------


def test_kernels_setting_is_validated():
    with pytest.raises(ValueError, match=r"kernels='cuda' is invalid; kernels must be one of \('torch', 'triton'\)"):
        FlexDeMoConfig(kernels="cuda")
    with pytest.raises(ValueError, match="with scheme='random' it would be ignored; write kernels='torch'"):
        FlexDeMoConfig(kernels="triton", scheme="random")
    with pytest.raises(ValueError, match="chunk=128 cannot be combined with kernels='triton'.*chunk <= 64"):
        FlexDeMoConfig(kernels="triton", chunk=128)


def test_triton_on_the_cpu_without_the_interpreter_is_refused_before_training(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU, and TRITON_INTERPRET=1 .* is not set; write kernels='torch'"):
        FlexDeMo([torch.nn.Parameter(torch.zeros(4))], kernels="triton")
    from hf_flexdemo.kernels import check_bucket

    with pytest.raises(ValueError, match="parameters are on the CPU, where Triton runs only under TRITON_INTERPRET"):
        check_bucket(torch.device("cpu"), torch.float32, 64)


def test_triton_not_installed_is_refused(monkeypatch):
    from hf_flexdemo import kernels

    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"Triton is not installed \(pip install triton.*write kernels='torch'"):
        FlexDeMoConfig(kernels="triton")


@needs_triton
def test_float64_parameters_are_refused_at_the_first_step():
    params = [torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.float64, device=DEVICE))]
    opt = FlexDeMo(params, kernels="triton", update="sign")
    params[0].grad = torch.ones_like(params[0])
    with pytest.raises(ValueError, match="torch.float64 keep a torch.float64 momentum: write kernels='torch'"):
        opt.step()


@needs_triton
def test_optim_args_kernels_triton_reaches_the_optimizer(tmp_path):
    from transformers import TrainingArguments

    from hf_flexdemo.integrations.training_args import describe, flexdemo_kwargs

    args = TrainingArguments(str(tmp_path), optim="flexdemo", optim_args="kernels=triton,update=sign", use_cpu=True)
    kwargs = flexdemo_kwargs(args)
    assert kwargs["kernels"] == "triton"
    assert "kernels='triton'" in describe(args)
    assert FlexDeMo([torch.nn.Parameter(torch.zeros(4))], **kwargs).config.kernels == "triton"


# -- compiled for a GPU -------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize(
    ("device", "capability", "hip", "expected"),
    [
        ("cpu", None, None, "ieee"),  # the interpreter
        ("cuda", (8, 0), None, "tf32x3"),
        ("cuda", (9, 0), None, "tf32x3"),
        ("cuda", (7, 5), None, "ieee"),  # no TF32 before Ampere
        ("cuda", (9, 4), "6.2", "ieee"),  # ROCm: no tf32x3
    ],
)
def test_products_take_three_tf32_products_only_where_the_gpu_has_tf32(monkeypatch, device, capability, hip, expected):
    from hf_flexdemo.kernels._triton_common import dot_precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    dot_precision.cache_clear()
    try:
        where = torch.device(device, 0) if device == "cuda" else torch.device(device)
        assert dot_precision.__wrapped__(where) == expected
    finally:
        dot_precision.cache_clear()


COMPILE = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_flexdemo.kernels.demo_encode import _demo_encode_kernel
from hf_flexdemo.kernels.sign_decode import _sign_decode_kernel

def compile(fn, pointers, scalars, constants):
    signature = {**pointers, **scalars, **{name: "constexpr" for name in constants}}
    names = list(signature)
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})

encode = dict(grad_table_ptr="*i64", q_ptr="*fp32", left_ptr="*fp32", right_ptr="*fp32", noise_ptr="*fp32",
              index_ptr="*i32", value_ptr="*fp32", code_ptr="*u8", scale_ptr="*fp32")
for precision in ("tf32x3", "ieee"):  # what dot_precision gives sm_80 and newer, and older GPUs
    compile(_demo_encode_kernel, encode, dict(cols="i32", grid_cols="i32", tiles_per_grad="i32", decay="fp32",
            lr="fp32"), dict(GRAD=1, TILE_ROWS=13, TILE_COLS=40, A=16, B=64, K=32, SELECT=True, BITS=2, LEVELS=1,
            STOCHASTIC=True, WIRE=0, PRECISION=precision))
for store, precision in itertools.product((False, True), ("tf32x3", "ieee")):  # storing: the table is the indices
    decode = dict(table_ptr="*i32" if store else "*i64", out_ptr="*fp32", index_ptr="*i32", value_ptr="*bf16",
                  left_ptr="*fp32", right_ptr="*fp32")
    compile(_sign_decode_kernel, decode, dict(n_tiles="i32", cols="i32", grid_cols="i32", tiles_per_param="i32",
            neg_lr="fp32", decay="fp32"), dict(REPLICAS=3, K=100, KB=64, TILE_ROWS=7, TILE_COLS=40, A=16, B=64,
            SELECTED=True, SIGN=False, PARAM=1, STORE=store, DECAY=not store, PRECISION=precision))
from hf_flexdemo.kernels.rule_step import _rule_step_kernel

for adam in (False, True):
    rule = dict(table_ptr="*i64", step_ptr="*bf16", v_ptr="*fp32", correction_ptr="*fp32")
    compile(_rule_step_kernel, rule, dict(numel="i32", blocks_per_param="i32", alpha="fp32", lr="fp32", beta2="fp32",
            one_minus_beta2="fp32", eps="fp32", decay="fp32"), dict(BLOCK=1024, ADAM=adam, PARAM=1, DECAY=True))
print("compiled")
"""


@needs_triton
def test_kernels_compile_for_a_cuda_gpu():
    """What the interpreter does not check (types, layouts, the int-to-pointer table): the kernels compile for an
    H100 (sm_90) with the ptxas Triton ships, no GPU needed."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COMPILE)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


LATE_INTERPRETER = """
import os
import triton.language  # before the interpreter is switched on, as `from transformers import Trainer` does
os.environ["TRITON_INTERPRET"] = "1"
import torch
from hf_flexdemo.compression import ChunkPlan, select_topk
from hf_flexdemo.kernels.demo_encode import demo_encode
from hf_flexdemo.kernels.sign_decode import sign_decode
plan = ChunkPlan.for_shape((7, 14), 7, 5).stacked(2)
encoded = demo_encode(torch.randn(2, 7, 14), torch.randn(plan.rows, plan.cols), plan, decay=0.9, lr=0.5,
                      select=True, bits=1, wire_dtype=torch.float32)
parts = [(encoded.indices, encoded.values), select_topk(torch.randn(plan.rows, plan.cols), plan)]
sign_decode([torch.zeros(7, 14), torch.zeros(7, 14)], parts, plan, mode="selected", lr=0.1, sign=True, decay=0.9)
from hf_flexdemo.kernels.rule_step import adam_step, add_step
params = [torch.zeros(7, 14), torch.zeros(7, 14)]
add_step(params, torch.ones(2, 7, 14), -0.5, decay=0.9)
adam_step(params, torch.ones(2, 7, 14), torch.zeros(2, 7, 14), torch.ones(2), lr=0.1, beta2=0.9, eps=1e-8, decay=0.9)
print("ran")
"""


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's own check (torch 2.11 with Triton 3.6 refuses it)")
def test_kernels_run_interpreted_where_triton_was_imported_before_the_interpreter_was_switched_on():
    """The interpreter cannot call Triton's compiled-only standard library (tl.sum, tl.zeros, ...): the kernels use
    builtins only, so a worker that imported Triton early (through transformers' Trainer) still runs them."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LATE_INTERPRETER)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]
