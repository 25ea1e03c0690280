"""``benchmarks/step/gpu_step.py --node_of N``: one rank's shards and owned matrices, from shapes alone (meta tensors).

The GPU timing itself needs a GPU; what it times is decided here, on CPU: the FSDP2 shard shapes and
the whole matrices each rank orthogonalizes under the owner split of ``deal_owners``.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from support.launch import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "step"))

from gpu_step import build_model, node_shard_plan  # noqa: E402

from hf_flexdemo import elementwise_parameters  # noqa: E402

pytestmark = pytest.mark.unit

N = 8


@pytest.fixture(scope="module", params=["olmo2-1b", "t5-small"])
def model(request):
    return build_model(request.param, device="meta")


@pytest.fixture(scope="module")
def plans(model):
    return [node_shard_plan(model, N, rank) for rank in range(N)]


def test_shards_are_torch_chunks_row_split(model, plans):
    params = list(model.parameters())
    for rank, plan in enumerate(plans):
        assert plan.whole_shapes == tuple(p.shape for p in params)
        for p, shard in zip(params, plan.shard_shapes):
            chunks = torch.empty(p.shape, device="meta").chunk(N)  # FSDP2 pads the missing chunks with empty ones
            expected = chunks[rank].shape if rank < len(chunks) else torch.Size((0, *p.shape[1:]))
            assert shard == expected, (tuple(p.shape), rank)
    # Rank 0's shards are the largest: the one the benchmark times.
    for shapes in zip(*(plan.shard_shapes for plan in plans)):
        assert shapes[0].numel() == max(s.numel() for s in shapes)


def test_every_whole_matrix_is_owned_by_exactly_one_rank(model, plans):
    tables = {id(p) for p in elementwise_parameters(model)}
    matrices = Counter(tuple(p.shape) for p in model.parameters() if p.dim() == 2 and id(p) not in tables)
    assert plans[0].orthogonalized == tuple(p.dim() == 2 and id(p) not in tables for p in model.parameters())
    in_buckets = Counter()
    for exchange in plans[0].exchanges:
        for count, rows, cols in exchange.matrices:
            in_buckets[(rows, cols)] += count
    assert in_buckets == matrices  # the buckets cover the 2-D weights, each once
    for i, exchange in enumerate(plans[0].exchanges):
        assert all(plan.exchanges[i].matrices == exchange.matrices for plan in plans)  # every rank deals alike
        for j, (count, _, _) in enumerate(exchange.matrices):
            assert sum(plan.exchanges[i].owned[j] for plan in plans) == count


def test_rank_0s_load_is_within_one_matrix_of_the_average(plans):
    load = [sum(count * rows * cols for count, rows, cols in plan.owned_matrices()) for plan in plans]
    largest = max(rows * cols for exchange in plans[0].exchanges for _, rows, cols in exchange.matrices)
    assert abs(load[0] - sum(load) / N) <= largest, load


def test_the_all_to_alls_balance_across_the_node(plans):
    """What each rank sends, some rank receives: the totals over the node agree."""
    sent = sum(plan.all_to_all_bytes(torch.bfloat16)[0] for plan in plans)
    received = sum(plan.all_to_all_bytes(torch.bfloat16)[1] for plan in plans)
    assert sent == received > 0


def test_the_plans_batches_are_the_ones_the_optimizer_hands_its_rule(monkeypatch):
    """The plan mirrors how FlexDeMo batches decoded buckets for the rule: one process (N = 1), a small cap."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from hf_flexdemo import FlexDeMo
    from hf_flexdemo.updates.orthogonal import OrthogonalRule

    torch.manual_seed(0)
    model = Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))
    monkeypatch.setattr(FlexDeMo, "bucket_entries", 6000)  # shapes in several buckets, batches of mixed shapes
    seen = []
    apply = OrthogonalRule.apply

    def recording(self, decoded, ctx):
        matrices = tuple((d.bucket.count, *d.bucket.full_shape) for d in decoded if self.is_matrix(d))
        seen.extend([matrices] if matrices else [])
        return apply(self, decoded, ctx)

    monkeypatch.setattr(OrthogonalRule, "apply", recording)
    opt = FlexDeMo(model.parameters(), topk=4, chunk=8, elementwise=elementwise_parameters(model))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    plan = node_shard_plan(model, 1)
    assert len(seen) > 2 and any(len({shape[1:] for shape in batch}) > 1 for batch in seen), seen
    assert [exchange.matrices for exchange in plan.exchanges] == seen
