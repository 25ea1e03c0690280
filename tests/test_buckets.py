"""Buckets: one buffer per state entry and bucket, built once, and checkpoints of the per-tensor step."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from hf_flexdemo import FlexDeMo
from hf_flexdemo.buckets import Bucket

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "state_e3bbd13.pt"
"""Written by e3bbd13's optimizer (a loop over tensors): its state after 3 steps and its parameters after 5,
for update=sign and the default rule, on 5 tensors in 4 shapes (two of one shape share a bucket now)."""


def steps(opt, params, grads):
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.step()


@pytest.mark.parametrize("config", ["sign", "orthogonal_adam"])
def test_a_checkpoint_of_the_per_tensor_step_resumes_and_continues_its_run(config):
    saved = torch.load(FIXTURE, weights_only=False)
    params = [torch.nn.Parameter(t.clone()) for t in saved[config]["params_at_3"]]
    # elementwise_update='adam', written by the fixture, is the only rule beside 'orthogonal' now
    rules = {key: value for key, value in saved["configs"][config].items() if key != "elementwise_update"}
    if rules["update"] == "orthogonal":  # the checkpoint's Newton-Schulz was float32 (today's default is bf16)
        rules = {**rules, "ns_dtype": "float32"}
    opt = FlexDeMo(params, **saved["hp"], **rules, elementwise=params[:1])
    opt.load_state_dict(saved[config]["state"])
    steps(opt, params, saved["grads"][3:])
    # sign: the same arithmetic per tile, batched; orthogonal: float32 Newton-Schulz fused differently (baddbmm).
    atol = 0 if config == "sign" else 1e-6
    for mine, theirs in zip(params, saved[config]["params_at_5"]):
        torch.testing.assert_close(mine.detach(), theirs, atol=atol, rtol=0)


def test_state_entries_are_views_of_one_buffer_per_bucket_built_once():
    shapes = [(8, 4), (8, 4), (6,), (8, 4)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = FlexDeMo(params, update="sign", topk=3, chunk=4)
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    steps(opt, params, grads[:1])
    buckets = opt.book.buckets
    assert [bucket.count for bucket in buckets] == [3, 1]  # the (8, 4) matrices, the vector
    momentum = buckets[0].buffers["momentum_dct"]
    for p in (params[0], params[1], params[3]):
        entry = opt.state[p]["momentum_dct"]
        assert entry.untyped_storage().data_ptr() == momentum.untyped_storage().data_ptr()
    steps(opt, params, grads[1:])
    assert opt.book.buckets is buckets  # not rebuilt per step
    opt.load_state_dict(opt.state_dict())
    steps(opt, params, grads[:1])
    assert opt.book.buckets is not buckets  # rebuilt on the loaded state
    assert opt.state[params[1]]["momentum_dct"].untyped_storage().data_ptr() == (
        opt.book.buckets[0].buffers["momentum_dct"].untyped_storage().data_ptr()
    )


def test_large_shapes_are_bucketed_in_pieces_that_bound_a_phases_temporaries():
    from hf_flexdemo.buckets import ParamSlot, build_buckets
    from hf_flexdemo.state_store import StateStore, StateView
    from hf_flexdemo.topology import ReplicaTopology

    store, group = StateStore(ReplicaTopology.single()), {}
    params = [torch.zeros(4, 8) for _ in range(5)] + [torch.zeros(100)]
    slots = [ParamSlot(p, StateView(store, p, p, {}), group, i) for i, p in enumerate(params)]
    buckets = build_buckets([slots], max_entries=64)
    assert [bucket.count for bucket in buckets] == [2, 2, 1, 1]  # 32 entries each; 100 alone, though above 64
    assert [slot.index for bucket in buckets for slot in bucket.slots] == list(range(6))


def test_a_parameter_whose_storage_was_replaced_is_still_the_one_that_moves():
    """FSDP2 re-shards into new storage after a move (``module.to``): the buckets follow, not the old tensor."""
    params = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(2)]
    opt = FlexDeMo(params, update="sign", topk=3, chunk=4)
    grads = [[torch.randn(8, 4) for _ in range(2)] for _ in range(2)]
    steps(opt, params, grads[:1])
    old = params[0].data
    params[0].data = old.clone()
    before = params[0].detach().clone()
    steps(opt, params, grads[1:])
    assert not torch.equal(params[0].detach(), before)
    assert opt.book.buckets[0].slots[0].param.data_ptr() == params[0].data_ptr()


def test_every_process_of_a_node_builds_the_same_buckets_from_uneven_shards():
    """(5, 3) and (6, 3) over 2 processes: rank 0 holds two (3, 3) shards, rank 1 a (2, 3) and a (3, 3). The
    orthogonal rule deals a node's buckets to owners, so both ranks must see the same two buckets."""
    from types import SimpleNamespace

    from hf_flexdemo.buckets import ParamSlot, build_buckets

    wholes = [torch.zeros(5, 3), torch.zeros(6, 3)]
    per_rank = []
    for rank in range(2):
        slots = []
        for i, whole in enumerate(wholes):
            local = torch.chunk(whole, 2)[rank]
            state = SimpleNamespace(param=whole)
            slots.append(ParamSlot(local, state, {}, i))
        per_rank.append([[tuple(s.state.param.shape) for s in b.slots] for b in build_buckets([slots])])
    assert per_rank[0] == per_rank[1] == [[(5, 3)], [(6, 3)]]


@pytest.mark.parametrize("update", ["sign", "orthogonal"])
def test_a_step_holds_one_buckets_gradients_and_a_buckets_worth_of_decoded_updates_at_a_time(monkeypatch, update):
    """The step's memory above its state is bounded by a bucket, not by the model: every bucket's stacked
    gradients, or every bucket's dense decoded update, alive at once is what made OLMo2-1B's step peak at
    1.9x its state on a GPU."""
    cap = 2 * 16 * 16
    monkeypatch.setattr(FlexDeMo, "bucket_entries", cap)
    shapes = [(16, 16)] * 6 + [(16,)] * 6
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = FlexDeMo(params, topk=4, chunk=8, update=update)
    grads = [[torch.randn(s) for s in shapes] for _ in range(2)]
    steps(opt, params, grads[:1])
    assert [bucket.count for bucket in opt.book.buckets] == [2, 2, 2, 6]

    stacks, batches = [], []
    stacked = Bucket.grad.fget

    def stacked_and_watched(bucket):
        made = bucket.stacked_grad is None
        grad = stacked(bucket)
        if made:
            assert not [ref for ref in stacks if ref() is not None], "an earlier bucket's gradients are still held"
            stacks.append(weakref.ref(grad))
        return grad

    rule = opt.rules[update]
    apply = rule.apply

    def apply_and_watch(decoded, ctx):
        assert not [ref for batch in batches for ref in batch if ref() is not None], "earlier updates are held"
        entries = [item.bucket.count * item.bucket.numel for item in decoded]
        assert sum(entries) - entries[-1] < cap  # the batch closed at the first bucket that filled it
        apply(decoded, ctx)
        batches.append([weakref.ref(item.update) for item in decoded])

    monkeypatch.setattr(Bucket, "grad", property(stacked_and_watched))
    monkeypatch.setattr(rule, "apply", apply_and_watch)
    steps(opt, params, grads[1:])
    assert len(stacks) == 4 and len(batches) == 4
