"""Update rules (hf_flexdemo.updates) in one process: against the reference, state, refusals, cost."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from test_optimizer_single import assert_host_syncs_bounded, make_params, run_with_reference, small, train

from hf_flexdemo import FlexDeMo, FlexDeMoConfig
from hf_flexdemo.fault_tolerance.rounds import QuorumRounds
from hf_flexdemo.updates import elementwise_parameters, newton_schulz

pytestmark = pytest.mark.unit

RULES = ("adam", "orthogonal")
# Orthogonal needs whole matrices: random and striding send scattered entries (refused).
COMBINATIONS = [(scheme, update) for scheme in ("demo", "full", "none") for update in RULES]
COMBINATIONS += [("demo", "adam_every2"), ("demo", "orthogonal_adam")]


@pytest.mark.parametrize(("scheme", "update"), COMBINATIONS)
def test_one_replica_matches_the_reference(scheme, update):
    hp = {"scheme": scheme, "update": update}
    if update == "adam_every2":  # bias correction counts replications
        hp.update(update="adam", replicate_every=2)
    if update == "orthogonal_adam":  # the tensors it does not orthogonalize take adam
        hp.update(update="orthogonal")
    params, opt, ref = run_with_reference(**hp)
    # Newton-Schulz runs in float32 in both (run_with_reference sets ns_dtype), one as a batched product with
    # fused additions: float32's rounding of a unit-scale step times lr bounds the difference there.
    atol = 1e-6 if update.startswith("orthogonal") else 1e-12
    for p, q in zip(params, ref.params[0]):
        torch.testing.assert_close(p.detach(), q, atol=atol, rtol=0)
    if "adam" in (opt.config.update, opt.config.elementwise_update):
        for p, v in zip(params, ref.second[0]):
            mine = opt.state[p].get("update_sq", torch.zeros_like(v))  # orthogonalized matrices keep none
            torch.testing.assert_close(mine, v, atol=1e-12, rtol=1e-12)


def test_rules_take_different_steps_from_the_same_update():
    """Not a relabelled sign rule: each rule moves a matrix differently."""
    moved = {}
    for update in ("sign", *RULES):
        params = make_params()
        opt = FlexDeMo(params, **small(update=update))
        train(opt, params, 3)
        moved[update] = params[3].detach().clone()  # the (20, 12) matrix
    assert not torch.allclose(moved["sign"], moved["adam"])
    assert not torch.allclose(moved["sign"], moved["orthogonal"])


@pytest.mark.parametrize("shape", [(48, 64), (64, 48)])
def test_muons_five_newton_schulz_steps_keep_the_singular_values_in_their_interval(shape):
    """The singular values of an update whose spectrum, divided by its norm, lies within [1e-3, 1] end in
    [0.471, 1.202], where Muon's five iterations take [1e-3, 1], with the same singular vectors."""
    low, high = 0.471, 1.202
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.linalg.svdvals(g).min() / torch.linalg.norm(g) > 1e-3
    o = newton_schulz(g).double()
    singular = torch.linalg.svdvals(o)
    assert low - 1e-3 < singular.min() and singular.max() < high + 1e-3, singular
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    inner = u.T @ o @ vh.T
    assert (inner - torch.diag(torch.diagonal(inner))).abs().max() < 1e-4


@pytest.mark.parametrize("shape", [(20, 12), (12, 20), (64, 64)])
def test_newton_schulz_pushes_singular_values_towards_one(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    singular = torch.linalg.svdvals(newton_schulz(g).double())
    lifted = torch.linalg.svdvals(g) > 0.05 * torch.linalg.svdvals(g).max()  # five steps lift all but the tiniest
    assert singular[lifted].min() > 0.6 and singular.max() < 1.25, singular
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    o = newton_schulz(g).double()
    # Same singular vectors: O is U diag(s') V^T with s' > 0, so U^T O V is diagonal.
    inner = u.T @ o @ vh.T
    assert (inner - torch.diag(torch.diagonal(inner))).abs().max() < 1e-4


def test_orthogonal_step_has_the_size_of_a_sign_step():
    """sqrt(max(rows, cols)) scaling: the same lr moves a matrix about as far as sign does."""
    p = torch.nn.Parameter(torch.zeros(48, 16, dtype=torch.float64))
    opt = FlexDeMo([p], lr=1.0, update="orthogonal", topk=64, chunk=8)
    p.grad = torch.randn(48, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    opt.step()
    rms = p.detach().pow(2).mean().sqrt().item()
    assert 0.5 < rms < 1.2, rms


@pytest.mark.parametrize("update", RULES)
def test_state_dict_round_trip_continues_the_same_run(update):
    params = make_params()
    hp = small(update=update)
    opt = FlexDeMo(params, **hp)
    train(opt, params, 5)
    saved_params = copy.deepcopy([p.detach() for p in params])
    saved_state = copy.deepcopy(opt.state_dict())
    train(opt, params, 5, first=5)
    params2 = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = FlexDeMo(params2, **hp)
    opt2.load_state_dict(saved_state)
    train(opt2, params2, 5, first=5)
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


def test_adaptive_second_moment_is_shared_state_a_healing_node_copies():
    params = make_params()
    opt = FlexDeMo(params, **small(update="adam"))
    train(opt, params, 3)
    peer = QuorumRounds(opt).replica_state()
    assert all("update_sq" in state for state in peer["state"])
    fresh = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    healed = FlexDeMo(fresh, **small(update="adam"))
    QuorumRounds(healed).load_replica_state(peer)
    for p, q in zip(params, fresh):
        assert torch.equal(opt.state[p]["update_sq"], healed.state[q]["update_sq"])


def test_zero_gradient_step_with_zero_lr_changes_nothing():
    """torch's distributed checkpoint creates state this way; the adaptive rule must not divide by lr = 0."""
    for update in RULES:
        params = make_params(seed=3)
        before = [p.detach().clone() for p in params]
        opt = FlexDeMo(params, **small(lr=0.0, update=update))
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, q in zip(params, before):
            assert torch.equal(p.detach(), q)
        assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("update", RULES)
def test_a_step_reads_back_a_bounded_number_of_values(update):
    assert_host_syncs_bounded(update=update)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 10)

    def get_output_embeddings(self):
        return self.lm_head


def test_embeddings_and_heads_take_the_elementwise_rule_under_orthogonal():
    model = TinyLM()
    kept = elementwise_parameters(model)
    assert {id(p) for p in kept} == {id(model.embed.weight), id(model.lm_head.weight), id(model.lm_head.bias)}
    opt = FlexDeMo(model.parameters(), update="orthogonal", elementwise=kept)
    by_rule = {group["update"]: {id(p) for p in group["params"]} for group in opt.param_groups}
    assert by_rule["adam"] == {id(p) for p in kept}
    assert by_rule["orthogonal"] == {id(model.hidden.weight), id(model.hidden.bias)}


DEFAULTS = [
    # (scheme, sign) -> (update, elementwise_update) that update=None and elementwise_update=None stand for
    (("demo", True), ("orthogonal", "adam")),
    (("full", True), ("orthogonal", "adam")),
    (("none", True), ("orthogonal", "adam")),
    (("random", True), ("sign", "sign")),  # a scattered subset: no whole matrix, no per-entry count
    (("striding", True), ("sign", "sign")),
    (("diloco", True), ("sign", "sign")),  # their own outer step, AdamW inside unless update='orthogonal'
    (("sparseloco", True), ("sign", "sign")),
    (("demo", False), ("sign", "sign")),  # sign=False is the sign rule's variant
]


@pytest.mark.parametrize(("settings", "resolved"), DEFAULTS)
def test_the_default_rule_is_orthogonal_with_adam_for_the_rest_where_it_applies(settings, resolved):
    scheme, sign = settings
    given = {} if sign else {"sign": False}  # sign=True is read by the sign rule alone: given elsewhere, refused
    config = FlexDeMoConfig(scheme=scheme, **given)
    assert (config.update, config.elementwise_update) == resolved
    params = make_params()
    opt = FlexDeMo(params, scheme=scheme, **given, elementwise=params[:1])
    assert {group["update"] for group in opt.param_groups} == set(resolved)
    if scheme in ("diloco", "sparseloco"):  # there an explicit 'sign' would read as AdamW inside: refused
        with pytest.raises(ValueError, match="update='sign' does not apply"):
            FlexDeMoConfig(scheme=scheme, **given, update="sign")
    else:
        assert FlexDeMoConfig(scheme=scheme, sign=sign, update="sign").elementwise_update == "sign"


def test_the_default_rule_trains_like_its_explicit_settings():
    explicit, default = make_params(), make_params()
    a = FlexDeMo(explicit, **small(update="orthogonal"))
    b = FlexDeMo(default, **small())
    train(a, explicit, 3)
    train(b, default, 3)
    for p, q in zip(explicit, default):
        assert torch.equal(p, q)


REFUSED = [
    (dict(update="lion"), "update='lion'", "'sign', 'adam', 'orthogonal'"),
    (dict(update="adam", scheme="diloco"), "update='adam'", "leave update unset (inner AdamW)"),
    (dict(update="adam", scheme="sparseloco"), "per-step schemes", "or set update='orthogonal'"),
    (dict(update="orthogonal", scheme="random"), "scattered subset", "scheme='demo' or 'full'"),
    (dict(update="adam", scheme="striding"), "scattered subset", "update='sign' with striding"),
    (dict(update="adam", sign=False), "sign=False applies to update='sign'", "drop sign"),
    (dict(update="orthogonal", sign=True), "sign=True applies to update='sign'", "drop sign"),
    (dict(update="orthogonal", betas=(0.9, 1.5)), "betas[1]=1.5", "[0.0, 1.0)"),
    (dict(update="adam", betas=(0.9, 1.0)), "betas[1]=1.0", "[0.0, 1.0)"),
    (dict(update="adam", eps=0.0), "eps=0.0", "(0.0, inf)"),
]


@pytest.mark.parametrize(("kwargs", "names", "allowed"), REFUSED)
def test_bad_update_settings_are_refused_with_the_fix(kwargs, names, allowed):
    with pytest.raises(ValueError) as info:
        FlexDeMoConfig(**kwargs)
    assert names in str(info.value) and allowed in str(info.value), str(info.value)


def test_update_is_read_from_optim_args_and_per_group():
    assert FlexDeMoConfig.from_optim_args("update=orthogonal").update == "orthogonal"
    params = make_params()
    opt = FlexDeMo([{"params": params[:3]}, {"params": params[3:], "update": "adam"}], update="orthogonal")
    assert [g["update"] for g in opt.param_groups] == ["orthogonal", "adam"]
    with pytest.raises(ValueError, match="update='adam' applies to the per-step schemes"):
        FlexDeMo([{"params": params[:3]}, {"params": params[3:], "update": "adam"}], scheme="diloco")


def test_a_warm_up_step_at_lr_0_counts_nothing_in_adams_bias_correction():
    """lr = 0 folds nothing into the momentum and moves nothing: the run equals one that skipped that step."""
    warmed, fresh = make_params(), make_params()
    hp = small(update="adam")
    a, b = FlexDeMo(warmed, **{**hp, "lr": 0.0}), FlexDeMo(fresh, **hp)
    train(a, warmed, 1)
    a.param_groups[0]["lr"] = hp["lr"]
    train(a, warmed, 1, first=1)
    train(b, fresh, 1, first=1)
    for p, q in zip(warmed, fresh):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["update_sq"], b.state[q]["update_sq"])
        assert float(a.state[p]["update_count"]) == float(b.state[q]["update_count"]) == 1


def test_resuming_with_another_update_rule_is_refused_naming_the_checkpoints():
    params = make_params()
    opt = FlexDeMo(params, **small(update="sign"))
    train(opt, params, 2)
    saved = opt.state_dict()
    with pytest.raises(ValueError, match=r"update='sign', but this run sets update='adam'.*Resume with update='sign'"):
        FlexDeMo(make_params(), **small(update="adam")).load_state_dict(saved)
    for group in saved["param_groups"]:  # a checkpoint from before the setting existed: sign steps
        del group["update"]
    resumed = make_params()
    old = FlexDeMo(resumed, **small(update="sign"))
    old.load_state_dict(saved)
    train(old, resumed, 1, first=2)  # and it steps
    with pytest.raises(ValueError, match=r"update='sign', but this run sets update='orthogonal'"):
        FlexDeMo(make_params(), **small(update="orthogonal")).load_state_dict(saved)


def test_a_sign_checkpoint_resumed_under_the_default_rule_names_the_setting_to_write():
    """A run saved before the default changed (sign, one group) and resumed with the new default (two groups)."""
    params = make_params()
    opt = FlexDeMo(params, **small(update="sign"))
    train(opt, params, 2)
    saved = opt.state_dict()
    fresh = make_params()
    with pytest.raises(ValueError) as info:
        FlexDeMo(fresh, **small(), elementwise=fresh[:1]).load_state_dict(saved)
    message = str(info.value)
    assert "1 parameter groups trained with update='sign'" in message
    assert "2 with update='orthogonal'/'adam'" in message and "(update='sign' in optim_args)" in message


def test_a_removed_setting_in_a_parameter_group_is_refused_as_removed():
    params = make_params()
    with pytest.raises(ValueError, match=r"a parameter group's: elementwise_update was removed: .* 17d8727"):
        FlexDeMo([{"params": params[:2]}, {"params": params[2:], "elementwise_update": "sign"}])


def test_matrices_are_dealt_to_owners_largest_first_to_the_least_loaded():
    from hf_flexdemo.updates.orthogonal import deal_owners

    # Buckets of (matrices, entries each): one of 100, one of 10, two of 50.
    assert deal_owners(((1, 100), (1, 10), (2, 50)), 2) == ((1, 0), (1, 0), (0, 2))  # loads 110 and 100
    assert deal_owners(((3, 5),), 4) == ((1, 1, 1, 0),)  # a process may own nothing
    assert deal_owners((), 2) == ()


def without_adam_state(saved: dict) -> dict:
    """``saved`` as a run with elementwise_update='sign' (taken out) wrote it: the orthogonal groups' other tensors
    and the embeddings' group on the sign rule, which keeps no state beside the momentum."""
    for group in saved["param_groups"]:
        group["update"] = "sign" if group["update"] == "adam" else group["update"]
    for state in saved["state"].values():
        for key in ("update_sq", "update_count"):
            state.pop(key, None)
    return saved


def test_a_checkpoint_of_orthogonal_with_sign_for_the_rest_is_refused_as_removed_on_resume():
    """Saved with update=orthogonal and elementwise_update='sign', a setting taken out: refused, saying so."""
    params = make_params()
    opt = FlexDeMo(params, **small(update="orthogonal"), elementwise=params[:1])
    train(opt, params, 2)
    saved = without_adam_state(opt.state_dict())
    fresh = make_params()
    with pytest.raises(ValueError, match=r"elementwise_update='sign'\), which this version cannot resume.*17d8727"):
        FlexDeMo(fresh, **small(update="orthogonal"), elementwise=fresh[:1]).load_state_dict(saved)


def test_elementwise_parameters_matter_only_to_the_orthogonal_rule():
    params = make_params()
    for update in ("adam", "sign"):  # every tensor takes the rule: no group with another
        opt = FlexDeMo(params, update=update, elementwise=params[:1])
        assert [group["update"] for group in opt.param_groups] == [update]


def test_a_group_with_sign_false_keeps_the_sign_rule_when_update_is_left_unset():
    params = make_params()
    opt = FlexDeMo([{"params": params[:2]}, {"params": params[2:], "sign": False}], elementwise=[])
    assert [group["update"] for group in opt.param_groups] == ["orthogonal", "sign"]
    with pytest.raises(ValueError, match="sign=False applies to update='sign'"):  # a rule named for the optimizer
        FlexDeMo([{"params": params[:2]}, {"params": params[2:], "sign": False}], update="orthogonal", elementwise=[])


def test_the_default_rule_without_elementwise_parameters_says_what_it_orthogonalizes(caplog):
    with caplog.at_level("WARNING", logger="hf_flexdemo.optim.flexdemo"):
        FlexDeMo(make_params())
    assert "embedding tables and output heads included" in caplog.text and "elementwise_parameters" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_flexdemo.optim.flexdemo"):
        FlexDeMo(make_params(), elementwise=[])  # said: the model has none
        FlexDeMo(make_params(), update="orthogonal")  # named: the user chose it
    assert "embedding tables" not in caplog.text


class ThreadedAllToAll:
    """All-to-all among ``size`` threads, one per process of a node: a stand-in process group."""

    def __init__(self, size: int):
        self.size, self.barrier, self.posted, self.local = size, threading.Barrier(size), {}, threading.local()

    def __call__(self, tensor, *, send, receive, group):
        rank, call = self.local.rank, self.local.calls
        self.local.calls += 1
        assert sum(send) == tensor.numel()
        self.posted[call, rank] = (tensor, send)
        self.barrier.wait()
        pieces = []
        for source in range(self.size):
            sent, sizes = self.posted[call, source]
            assert sizes[rank] == receive[source], "sender and receiver disagree on a split"
            pieces.append(sent[sum(sizes[:rank]) : sum(sizes[: rank + 1])])
        self.barrier.wait()
        return torch.cat(pieces)


@pytest.mark.parametrize(
    ("buckets", "size"),
    [
        ([((5, 3), 1)], 4),  # uneven shards, the last empty; three processes own nothing
        ([((8, 8), 1), ((5, 3), 2), ((3, 7), 1), ((16, 2), 3), ((2, 9), 1)], 4),  # fewer rows than processes
        ([((10, 3), 7)], 3),  # several matrices per owner
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_each_owner_orthogonalizes_whole_matrices_and_every_process_gets_its_rows(
    monkeypatch, buckets, size, dtype, ns_dtype
):
    """Buckets of ``count`` matrices of one shape, row-sharded over ``size`` processes (threads here)."""
    from types import SimpleNamespace

    from hf_flexdemo.updates import orthogonal

    fake = ThreadedAllToAll(size)
    monkeypatch.setattr(orthogonal, "_all_to_all", fake)
    g = torch.Generator().manual_seed(0)
    wholes = [torch.randn(count, *shape, generator=g).to(dtype) for shape, count in buckets]
    rows_back = {}

    def process(rank):
        fake.local.rank, fake.local.calls = rank, 0
        items = []
        for whole in wholes:
            chunks = torch.chunk(whole, size, dim=1)  # FSDP2's row split of each matrix
            local = chunks[rank] if rank < len(chunks) else whole[:, :0]
            bucket = SimpleNamespace(full_shape=whole.shape[1:], count=whole.shape[0], shape=local.shape[1:])
            items.append(SimpleNamespace(bucket=bucket, update=local.reshape(-1)))
        rows_back[rank] = orthogonal._orthogonalize_by_owner(items, None, size, rank, ns_dtype)

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, whole in enumerate(wholes):
        mine = torch.cat([rows_back[rank][i] for rank in range(size)], dim=1)
        for m in range(whole.shape[0]):  # what one process computes alone, matrix by matrix
            torch.testing.assert_close(mine[m], orthogonal.newton_schulz(whole[m], dtype=ns_dtype), atol=0, rtol=0)


def test_newton_schulz_in_bf16_orthogonalizes_as_float32_does():
    """The default ns_dtype: Muon's bf16 iteration gives the float32 result to bf16's precision, and a tiny
    update (lr * grad about 1e-30, whose squares vanish in float32) gives the same step."""
    g = torch.Generator().manual_seed(0)
    update = torch.randn(4, 48, 32, generator=g)
    full = orthogonal_step(update, torch.float32)
    half = orthogonal_step(update, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    relative = (half.float() - full).norm() / full.norm()
    assert relative < 0.02, relative
    tiny = orthogonal_step(update * 2.0**-100, torch.bfloat16)  # a power of two: scaling it is exact
    torch.testing.assert_close(tiny, half, atol=0, rtol=0)


@pytest.mark.parametrize(
    "device,fast,expected",
    [
        ("cpu", (True, False), torch.bfloat16),  # AVX-512 BF16
        ("cpu", (False, True), torch.bfloat16),  # AMX
        ("cpu", (False, False), torch.float32),  # AVX-512 alone (oneDNN emulates bf16, 2.4x slower) or AVX2
        ("cuda", (8, 0), torch.bfloat16),  # Ampere and newer: bf16 tensor cores
        ("cuda", (7, 0), torch.float32),  # V100: no bf16 units
        ("mps", None, torch.float32),
    ],
)
def test_ns_dtype_auto_picks_bf16_only_where_the_device_multiplies_it_fast(monkeypatch, device, fast, expected):
    from hf_flexdemo.updates import orthogonal

    if device == "cpu":
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: fast[0])
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: fast[1])
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # says bf16 works, not fast
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: fast)
    assert orthogonal.newton_schulz_dtype("auto", torch.device(device)) == expected
    # An explicit choice stands on every device.
    assert orthogonal.newton_schulz_dtype("bf16", torch.device(device)) == torch.bfloat16
    assert orthogonal.newton_schulz_dtype("float32", torch.device(device)) == torch.float32


def test_the_optimizer_iterates_in_the_dtype_the_device_policy_gives(monkeypatch):
    """This CPU's answer forced both ways: the default rule follows it, and ns_dtype overrides it."""
    from hf_flexdemo.updates import orthogonal

    seen, iterate = [], orthogonal.newton_schulz
    monkeypatch.setattr(orthogonal, "newton_schulz", lambda m, **kw: seen.append(kw["dtype"]) or iterate(m, **kw))
    for fast, ns_dtype, expected in [
        (True, "auto", torch.bfloat16),
        (False, "auto", torch.float32),
        (False, "bf16", torch.bfloat16),
        (True, "float32", torch.float32),
    ]:
        monkeypatch.setattr(orthogonal, "multiplies_bf16_fast", lambda device, fast=fast: fast)
        seen.clear()
        params = make_params()
        opt = FlexDeMo(params, **small(update="orthogonal", ns_dtype=ns_dtype), elementwise=[])
        train(opt, params, 2)
        assert seen and set(seen) == {expected}, (fast, ns_dtype, seen)


def test_nodes_that_would_iterate_in_different_dtypes_do_not_fit_one_job(monkeypatch):
    """Under torchft each node decides alone: what it took is part of what nodes compare when they meet."""
    from hf_flexdemo.updates import orthogonal

    described = {}
    for fast in (True, False):
        monkeypatch.setattr(orthogonal, "multiplies_bf16_fast", lambda device, fast=fast: fast)
        opt = FlexDeMo(make_params(), **small(update="orthogonal"), elementwise=[])
        described[fast] = QuorumRounds(opt).replica.describe_layout()["settings"]["ns_dtype"]
    assert described[True] != described[False]
    assert "bf16" in described[True] and "float32" in described[False] and "set ns_dtype=" in described[False]
    opt = FlexDeMo(make_params(), **small(update="orthogonal", ns_dtype="float32"), elementwise=[])
    assert QuorumRounds(opt).replica.describe_layout()["settings"]["ns_dtype"] == "float32"


def orthogonal_step(update, dtype):
    from hf_flexdemo.updates.orthogonal import scaled_newton_schulz

    return scaled_newton_schulz(update, dtype)


def test_resuming_norms_and_biases_moved_by_the_removed_sign_rule_is_refused():
    """They share the orthogonal groups, so only their saved state tells which rule moved them."""
    params = make_params()
    opt = FlexDeMo(params, **small(update="orthogonal"), elementwise=[])
    train(opt, params, 2)
    FlexDeMo(make_params(), **small(update="orthogonal"), elementwise=[]).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match=r"elementwise_update was removed: .*BENCHMARKS.md"):
        FlexDeMo(make_params(), **small(update="orthogonal"), elementwise=[]).load_state_dict(
            without_adam_state(opt.state_dict())
        )


def _sharded_checkpoint(tmp_path, **hp):
    """A distributed checkpoint of FlexDeMo's state as Accelerate writes FSDP's (``optimizer_0``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = FlexDeMo(model.parameters(), lr=1e-2, elementwise=[], **hp)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    folder = tmp_path / "checkpoint-1" / "optimizer_0"
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(folder))
    return folder.parent


@pytest.mark.parametrize(
    ("saved", "resumed", "write"),
    [
        ({"update": "sign"}, {}, "update='sign', or with .* Resume with update=sign in optim_args"),
        ({}, {"update": "sign"}, "Resume with update=adam, or update=orthogonal \\(the default: drop update\\)"),
        ({"update": "adam"}, {"update": "sign"}, "Resume with update=adam"),
    ],
)
def test_a_sharded_checkpoint_of_other_rules_is_refused_before_torchs_loader_fails_or_drops_state(
    tmp_path, saved, resumed, write
):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from hf_flexdemo.integrations.trainer import _check_resumed_rules

    checkpoint = _sharded_checkpoint(tmp_path, **saved)
    config = FlexDeMoConfig(**resumed)
    with pytest.raises(ValueError, match=rf"checkpoint {checkpoint} (was trained with|keeps no adam state).*{write}"):
        _check_resumed_rules(checkpoint, config)
    _check_resumed_rules(checkpoint, FlexDeMoConfig(**saved))  # the same rules resume
    if saved == {"update": "sign"}:
        # What the refusal stands in front of: torch's loader asks for adam state the checkpoint lacks.
        from torch.distributed.checkpoint.api import CheckpointException

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        opt = FlexDeMo(model.parameters(), lr=1e-2, elementwise=[], **resumed)
        with pytest.raises(CheckpointException):
            dcp.load({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(checkpoint / "optimizer_0"))


@pytest.mark.parametrize(
    ("saved", "resumed", "write"),
    [
        ({"update": "orthogonal"}, {}, "Resume with update=orthogonal"),
        ({}, {"update": "orthogonal"}, "Resume with no update"),
    ],
)
def test_a_sharded_sparseloco_checkpoint_resumes_only_with_its_own_inner_step(tmp_path, saved, resumed, write):
    """Muon's inner step keeps no second moment for the matrices, AdamW's does: the other one is refused before
    torch's loader fails on the entry it lacks; the same one passes the check and the loader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from hf_flexdemo.integrations.trainer import _check_resumed_rules

    outer = {"scheme": "sparseloco", "inner_steps": 2}
    checkpoint = _sharded_checkpoint(tmp_path, **outer, **saved)
    with pytest.raises(ValueError, match=rf"checkpoint {checkpoint} was trained with .*{write}"):
        _check_resumed_rules(checkpoint, FlexDeMoConfig(**outer, **resumed))
    _check_resumed_rules(checkpoint, FlexDeMoConfig(**outer, **saved))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = FlexDeMo(model.parameters(), lr=1e-2, elementwise=[], **outer, **saved)
    dcp.load({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(checkpoint / "optimizer_0"))
