"""FlexDeMo in one process (one replica): the reference, state round trips, odd tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_flexdemo import FlexDeMo, FlexDeMoConfig
from hf_flexdemo.buckets import Bucket, ParamSlot, build_buckets
from hf_flexdemo.compression import (
    ChunkPlan,
    EliasFano,
    flat_positions,
    from_coefficients,
    select_topk,
    tiles,
    to_coefficients,
)
from hf_flexdemo.optim.flexdemo_reference import FlexDeMoReference
from hf_flexdemo.scheme_traits import SCHEME_SETTINGS, traits_of
from hf_flexdemo.schemes import DeMoScheme, StepContext
from hf_flexdemo.state_store import StateStore, StateView
from hf_flexdemo.topology import ReplicaTopology

pytestmark = pytest.mark.unit

SHAPES = [(), (1,), (7,), (20, 12), (5, 3, 3), (6, 1, 2, 2)]
SMALL = dict(topk=3, chunk=4, rate=0.25, inner_steps=3, lr=0.05, weight_decay=0.1, decay=0.9)


def small(**hp) -> dict:
    """SMALL with ``hp`` on top, less what the scheme does not read and would refuse: SMALL's own topk, chunk, rate
    and inner_steps where it reads none of them, and ``decay`` on diloco and sparseloco (their momentum is
    ``betas[0]``)."""
    merged = {**SMALL, **hp}
    traits = traits_of(merged.get("scheme", "demo"))
    for key in set(SMALL).intersection(SCHEME_SETTINGS) - set(hp) - traits.reads:
        del merged[key]
    if "decay" not in hp and traits.outer_steps:
        del merged["decay"]
    return merged


def make_params(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def grads_for(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


@pytest.mark.parametrize(
    "scheme, sign",
    [
        (scheme, sign)
        for sign in (False, True)
        for scheme in ("demo", "random", "striding", "full", "none", "diloco")
        if sign or scheme != "diloco"  # diloco reads no sign: its inner step is AdamW
    ],
)
def test_one_replica_matches_the_reference(scheme, sign):
    params, opt, ref = run_with_reference(scheme=scheme, **({} if sign else {"sign": False}))
    # The default rule on demo, full and none is orthogonal: its Newton-Schulz is a batched product with
    # fused additions (baddbmm), the reference's a plain one, both in float32, so they agree to float32's
    # rounding of a unit-scale step times lr (1e-6 here). Every other rule agrees to float64's.
    atol = 1e-6 if opt.config.update == "orthogonal" else 1e-12
    for p, q in zip(params, ref.params[0]):
        torch.testing.assert_close(p.detach(), q, atol=atol, rtol=0)


@pytest.mark.parametrize("update", ["sign", "orthogonal"])
def test_scaled_topk_matches_the_reference(update):
    """``scale_topk`` on tiles of 4 x 4 and smaller (top 6 of 16: a 3 x 4 tile keeps 5, 4.5 rounded up, and a 1 x 3
    one 1): the decoded updates as the reference computes them, with its own count per tile."""
    params, opt, ref = run_with_reference(scheme="demo", update=update, topk=6, scale_topk=True)
    _, unscaled, _ = run_with_reference(scheme="demo", update=update, topk=6)
    atol = 1e-6 if update == "orthogonal" else 1e-12
    for p, q in zip(params, ref.params[0]):
        torch.testing.assert_close(p.detach(), q, atol=atol, rtol=0)
    assert not all(torch.equal(p, q) for p, q in zip(params, unscaled.param_groups[0]["params"]))


def run_with_reference(steps: int = 12, **hp):
    """One replica of FlexDeMo and of the reference, stepped on the same gradients: (params, opt, ref)."""
    params = make_params()
    hp = small(**hp)
    if FlexDeMoConfig(**hp).update == "orthogonal":  # in float32 (the default, bf16, is checked in test_update_rules)
        hp.setdefault("ns_dtype", "float32")
    ref = FlexDeMoReference([p.detach() for p in params], replicas=1, **hp)
    opt = FlexDeMo(params, **hp)
    for step in range(steps):
        grads = grads_for(step, params)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step([grads])
    return params, opt, ref


def train(opt, params, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, grads_for(step, params)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("scheme", ["demo", "random", "diloco"])
def test_state_dict_round_trip_continues_the_same_run(scheme):
    params = make_params()
    opt = FlexDeMo(params, **small(scheme=scheme))
    train(opt, params, 5)
    saved_params = copy.deepcopy([p.detach() for p in params])
    saved_state = copy.deepcopy(opt.state_dict())
    train(opt, params, 5, first=5)

    params2 = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = FlexDeMo(params2, **small(scheme=scheme))
    opt2.load_state_dict(saved_state)
    assert set(opt2.state_dict()) == {"state", "param_groups"}
    train(opt2, params2, 5, first=5)
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
    assert opt2.total_stats == opt.total_stats


def test_16_bit_parameters_keep_float32_moments_through_load_state_dict():
    params = [torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))]
    opt = FlexDeMo(params, lr=1e-2)
    train(opt, params, 2)
    assert opt.state[params[0]]["momentum_dct"].dtype == torch.float32
    opt2 = FlexDeMo(params, lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[params[0]]["momentum_dct"].dtype == torch.float32


def test_zero_gradient_step_with_zero_lr_changes_nothing():
    """torch.distributed.checkpoint initialises optimizer state this way on every rank."""
    for scheme in ("demo", "random", "diloco", "full"):
        params = make_params(seed=3)
        before = [p.detach().clone() for p in params]
        opt = FlexDeMo(params, **small(scheme=scheme, lr=0.0, **({"inner_steps": 1} if scheme == "diloco" else {})))
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, q in zip(params, before):
            assert torch.equal(p.detach(), q)


@pytest.mark.parametrize("scheme", ["demo", "random", "diloco"])
def test_parameter_without_gradient_counts_as_zero_gradient(scheme):
    """A run where some gradients are None equals, bit for bit, one where they are zeros."""
    runs = []
    for explicit_zeros in (False, True):
        params = make_params()
        opt = FlexDeMo(params, **small(scheme=scheme))
        for step in range(3):
            for i, (p, g) in enumerate(zip(params, grads_for(step, params))):
                # Parameter 1 never gets a gradient; parameter 0 only on even steps.
                missing = i == 1 or (i == 0 and step % 2)
                p.grad = (torch.zeros_like(p) if explicit_zeros else None) if missing else g
            opt.step()
        runs.append((params, opt))
    (a, opt_a), (b, opt_b) = runs
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(value, opt_b.state[q][key]), key
    assert not torch.equal(a[1], make_params()[1])  # weight decay and the shared update still move it


def one_bucket(p: torch.nn.Parameter, opt: FlexDeMo) -> Bucket:
    """A bucket of ``p`` alone, as the optimizer's first step builds it, with ``p``'s gradient."""
    state = StateView(StateStore(ReplicaTopology.single()), p, p.detach(), {})
    slot = ParamSlot(p.detach(), state, opt.param_groups[0], 1)
    bucket = build_buckets([[slot]])[0].for_step()
    bucket.grads = [p.grad]
    return bucket


def test_demo_payload_is_uint16_indices_and_values_in_the_chosen_dtype():
    p = torch.nn.Parameter(torch.randn(128, 64))
    p.grad = torch.randn(128, 64)
    for value_dtype, expected in (("param", torch.float32), ("bf16", torch.bfloat16)):
        opt = FlexDeMo([p], value_dtype=value_dtype)
        payload = DeMoScheme(opt.config).local_step(one_bucket(p, opt), StepContext(step=1, replicate=True, replicas=1))
        indices, values = payload
        plan = ChunkPlan.for_shape((128, 64), 64, 32)
        assert indices.dtype == torch.uint16 and values.dtype == expected
        assert indices.shape == values.shape == (plan.n_tiles, 32)


def test_packed_indices_take_12_bits_each_for_64x64_tiles():
    p = torch.nn.Parameter(torch.randn(128, 64))
    p.grad = torch.randn(128, 64)
    opt = FlexDeMo([p], pack_indices=True)
    ctx = StepContext(step=1, replicate=True, replicas=1)
    indices, values = DeMoScheme(opt.config).local_step(one_bucket(p, opt), ctx)
    plan = ChunkPlan.for_shape((128, 64), 64, 32)
    assert indices.dtype == torch.uint8 and indices.numel() == plan.n_tiles * 32 * 12 // 8  # 25% fewer than uint16
    assert values.shape == (plan.n_tiles, 32)


def test_elias_fano_indices_take_9_bits_each_for_top_32_of_64x64_tiles_and_change_no_step():
    """The same indices in fewer bytes: three steps end bitwise where fixed-width indices do."""
    plan = ChunkPlan.for_shape((128, 64), 64, 32)
    ctx = StepContext(step=1, replicate=True, replicas=1)
    ends = []
    for coding in ("fixed", "elias_fano"):
        p = torch.nn.Parameter(torch.randn(128, 64, generator=torch.Generator().manual_seed(0)))
        p.grad = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
        opt = FlexDeMo([p], pack_indices=True, index_coding=coding, value_bits=2, elementwise=[])
        payload = DeMoScheme(opt.config).local_step(one_bucket(p, opt), ctx)
        index_bytes = sum(t.numel() for t in payload[: 1 if coding == "fixed" else 2])
        assert index_bytes == plan.n_tiles * 32 * (12 if coding == "fixed" else 9) // 8
        for _ in range(3):
            opt.step()
        ends.append(p.detach().clone())
    assert torch.equal(*ends)


SCALED_SHAPES = [(128, 128), (64, 128), (32, 128)]
"""At top 128 of 128 x 128 tiles, ``scale_topk`` keeps 128, 64 and 32 of these; unscaled, 128 of each."""


@pytest.mark.parametrize(
    "settings, expected",
    [({}, {False: 3 * 128 * 6, True: (128 + 64 + 32) * 6})],  # float32 values, 16-bit indices
    ids=["demo"],
)
def test_scale_topk_sends_each_smaller_tile_topks_share_of_a_full_tile(settings, expected):
    """Every tile sends the same share of its coefficients: the bytes of 2 simulated replicas."""
    sent = {}
    for scale in (False, True):
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
            for shape in SCALED_SHAPES
        ]
        opt = FlexDeMo(
            params, **{"chunk": 128, "topk": 128, **settings}, scale_topk=scale, simulate_replicas=2, elementwise=[]
        )
        for replica in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(replica + 1))
            if replica == 0:
                opt.next_replica()
        opt.step()
        sent[scale] = opt.last_step_stats.bytes_sent
    assert sent == expected


@pytest.mark.parametrize("scheme", ["demo", "sparseloco"])
def test_a_checkpoint_resumed_with_other_tiles_is_refused_not_trained_on_the_saved_ones(scheme):
    """torch restores the saved groups' chunk and topk: a run resumed with another preset would silently keep them."""
    params = [torch.nn.Parameter(torch.randn(128, 128, generator=torch.Generator().manual_seed(0)))]
    opt = FlexDeMo(params, scheme=scheme, wire="2bit" if scheme == "demo" else None, elementwise=[])
    params[0].grad = torch.ones(128, 128)
    opt.step()
    saved = opt.state_dict()
    if scheme == "demo":
        resumed = FlexDeMo(params, wire="top96_2bit", elementwise=[])
        message = r"group 0 with chunk=64, topk=32, but this run sets chunk=64, topk=96 \(wire='top96_2bit'\)"
    else:
        resumed = FlexDeMo(params, scheme=scheme, topk=16, elementwise=[])
        message = r"group 0 with chunk=64, topk=32, but this run sets chunk=64, topk=16; torch would restore"
    with pytest.raises(ValueError, match=message):
        resumed.load_state_dict(saved)
    FlexDeMo(params, scheme=scheme, wire="2bit" if scheme == "demo" else None, elementwise=[]).load_state_dict(saved)


def test_scale_topk_scales_sparselocos_top_k_too():
    """SparseLoCo picks entries, not coefficients: an outer step at ``outer_lr=1`` moves exactly the ones sent."""
    moved = {}
    for scale in (False, True):
        params = [
            torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
            for shape in SCALED_SHAPES
        ]
        anchors = [p.detach().clone() for p in params]
        opt = FlexDeMo(params, scheme="sparseloco", inner_steps=1, outer_lr=1.0, chunk=128, topk=128, scale_topk=scale)
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        opt.step()
        moved[scale] = [int((anchor != p.detach()).sum()) for anchor, p in zip(anchors, params)]
    assert moved == {False: [128, 128, 128], True: [128, 64, 32]}


def test_replicate_every_accumulates_without_moving_parameters():
    params = make_params()
    opt = FlexDeMo(params, **small(replicate_every=3, weight_decay=0.0))
    before = [p.detach().clone() for p in params]
    train(opt, params, 2)
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before))
    train(opt, params, 1, first=2)
    assert not all(torch.equal(p.detach(), q) for p, q in zip(params, before))


@pytest.mark.parametrize("scheme", ["diloco", "sparseloco"])
def test_update_orthogonal_makes_the_inner_step_muons_on_matrices_and_leaves_the_rest_to_adamw(scheme):
    """Between outer steps: momentum, Nesterov and Newton-Schulz on the matrix; the inner AdamW on the vector and
    on the embedding (``elementwise``); the matrix keeps no second moment."""
    from hf_flexdemo.updates import newton_schulz

    hp = dict(scheme=scheme, inner_steps=10, lr=0.02, betas=(0.9, 0.99))
    table = torch.randn(10, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params, twins = [*make_params(), torch.nn.Parameter(table.clone())], [*make_params(), torch.nn.Parameter(table)]
    matrix, embedding = params[3], params[-1]  # (20, 12), and a table the Trainer would name an embedding
    opt = FlexDeMo(params, update="orthogonal", ns_dtype="float32", elementwise=[embedding], **hp)
    adamw = FlexDeMo(twins, **hp)  # the inner AdamW everywhere
    start, momentum = matrix.detach().clone(), torch.zeros_like(matrix)
    for step in range(3):
        train(opt, params, 1, first=step)
        train(adamw, twins, 1, first=step)
        g = grads_for(step, params)[3]
        momentum = 0.9 * momentum + 0.1 * g
        nesterov = g + 0.9 * (momentum - g)
        start = start - 0.02 * 20**0.5 * newton_schulz(nesterov, dtype=torch.float32)
        torch.testing.assert_close(matrix.detach(), start, rtol=0, atol=1e-6)
    for i, (p, q) in enumerate(zip(params, twins)):
        if i != 3:
            assert torch.equal(p, q), p.shape
    assert "exp_avg_sq" not in opt.state[matrix] and "exp_avg_sq" in opt.state[embedding]
    assert "update_sq" not in opt.state[embedding]  # the rules keep no state of their own here


def test_diloco_synchronize_runs_one_outer_step_once():
    params = make_params()
    opt = FlexDeMo(params, **small(scheme="diloco", inner_steps=10))
    train(opt, params, 4)
    assert not opt.replicas_should_match
    assert opt.synchronize() is True
    assert opt.replicas_should_match
    assert opt.synchronize() is False  # nothing to do twice at the same step


@pytest.mark.parametrize("scheme", ["demo", "random", "full"])
def test_overlap_applies_the_same_updates_one_step_late(scheme):
    """With gradients that do not depend on the parameters, overlap + flush ends where the plain run does."""
    hp = small(scheme=scheme, weight_decay=0.0)
    plain, late = make_params(), make_params()
    opt_plain, opt_late = FlexDeMo(plain, **hp), FlexDeMo(late, **hp, overlap=True)
    train(opt_plain, plain, 6)
    train(opt_late, late, 6)
    assert not all(torch.equal(p, q) for p, q in zip(plain, late))  # the last update is still pending
    assert opt_late.flush() and not opt_late.flush()
    for p, q in zip(plain, late):
        assert torch.equal(p, q)


def test_overlap_moves_by_the_lr_of_the_step_that_computed_the_update():
    """A scheduler changes the lr between a step and its late update; the update keeps its own lr."""
    hp = small(weight_decay=0.0)
    plain, late = make_params(), make_params()
    opt_plain, opt_late = FlexDeMo(plain, **hp), FlexDeMo(late, **hp, overlap=True)
    for opt, params in ((opt_plain, plain), (opt_late, late)):
        decay_to_zero = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 4))
        for step in range(4):
            train(opt, params, 1, first=step)
            decay_to_zero.step()  # the lr is 0 after the last step
    opt_late.flush()
    for p, q in zip(plain, late):
        assert torch.equal(p, q)


def test_overlap_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="overlap=True applies to the per-step schemes"):
        FlexDeMo(make_params(), scheme="diloco", overlap=True)


def test_attach_after_the_first_step_is_refused():
    params = make_params()
    opt = FlexDeMo(params, **small())
    train(opt, params, 1)
    with pytest.raises(RuntimeError, match="before the first step"):
        opt.attach(None)


class _HostSyncCounter(TorchFunctionMode):
    """Counts the tensor calls that make a GPU wait for the host (values read back into Python)."""

    SYNCING = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.numpy,
    }

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.SYNCING
        return func(*args, **(kwargs or {}))


def assert_host_syncs_bounded(**hp) -> FlexDeMo:
    """Steps with 3 and with 30 parameters read back nothing after the first; returns the last optimizer."""
    counts = {}
    for n in (3, 30):
        params = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(n)]
        opt = FlexDeMo(params, **small(**hp))
        for _ in range(4):
            for p in params:
                p.grad = torch.randn_like(p)
            with _HostSyncCounter() as counter:
                opt.step()
            counts.setdefault(n, []).append(counter.count)
    # The first step checks the layout (once per parameter) and reads the step count; later steps keep it on
    # the host.
    assert counts[3][1:] == counts[30][1:] and max(counts[30][1:]) == 0, counts
    return opt


@pytest.mark.parametrize("scheme", ["demo", "random", "striding", "full", "diloco", "none"])
def test_a_step_reads_back_a_bounded_number_of_values_whatever_the_parameter_count(scheme):
    opt = assert_host_syncs_bounded(scheme=scheme)
    opt.state_dict()  # bytes counted on the host reach the state when it is read
    assert opt.total_stats.dense_bytes == 0  # one replica: nothing would cross nodes


def test_sparseloco_sending_everything_without_error_feedback_decay_is_diloco_without_momentum():
    """Top-k of a whole tile and beta = 0: the sparse pseudo-gradient is the dense one."""
    hp = dict(lr=0.05, inner_steps=3, outer_lr=0.7, outer_momentum=0.0)
    params, twins = make_params(torch.float32), make_params(torch.float32)
    sparse = FlexDeMo(params, scheme="sparseloco", topk=16, chunk=4, **hp)
    dense = FlexDeMo(twins, scheme="diloco", **hp)
    for step in range(7):
        for group, opt in ((params, sparse), (twins, dense)):
            for p, g in zip(group, grads_for(step, group)):
                p.grad = g
            opt.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


@pytest.mark.parametrize("value_bits", [0, 2])
def test_sparseloco_sends_top_k_and_keeps_the_rest_in_its_error_feedback(value_bits):
    """At the first outer step: sent + error feedback = the whole pseudo-gradient (a DiLoCo twin's)."""
    hp = dict(inner_steps=2, outer_lr=0.5)
    params, twins = make_params(torch.float32), make_params(torch.float32)
    anchors = [p.detach().clone() for p in params]
    sparse = FlexDeMo(params, scheme="sparseloco", topk=2, chunk=4, value_bits=value_bits, **hp)
    dense = FlexDeMo(twins, scheme="diloco", **{**hp, "outer_lr": 1.0, "outer_momentum": 0.0})  # p = theta - delta
    for step in range(2):
        for group, opt in ((params, sparse), (twins, dense)):
            for p, g in zip(group, grads_for(step, group)):
                p.grad = g
            opt.step()
    for i in (3, 4):  # (20, 12) and (5, 3, 3): several tiles each
        pseudo_gradient = anchors[i] - twins[i].detach()
        sent = (anchors[i] - params[i].detach()) / hp["outer_lr"]
        torch.testing.assert_close(sent + sparse.state[params[i]]["outer_error"], pseudo_gradient, rtol=1e-5, atol=1e-6)
    sent = anchors[3] - params[3].detach()  # (20, 12) in 4x4 tiles: 2 of every 16 entries
    assert 0 < (sent != 0).float().mean() <= 2 / 16


def test_a_closure_is_evaluated_with_gradients_on_and_its_loss_returned():
    """torch's contract: ``step(closure)`` re-evaluates the model (``step`` itself runs under no_grad)."""
    params = [torch.nn.Parameter(torch.ones(4, 4))]
    opt = FlexDeMo(params, lr=0.1, topk=2, chunk=4, elementwise=[])

    def closure():
        opt.zero_grad()
        loss = (params[0] ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 16.0 and not torch.equal(params[0].detach(), torch.ones(4, 4))
    assert opt.step() is None
