"""``simulate_replicas=R`` in one process: the Trainer path, checkpoints, and every misuse refused with what to set.

The bitwise comparison with R real nodes is tests/test_simulated_replicas.py.
"""

from __future__ import annotations

import io

import pytest
import torch
from support.tiny_hf import dataset, tiny_model, tokenizer
from support.tiny_models import OddShapes, batch
from transformers import Trainer, TrainingArguments, default_data_collator

import hf_flexdemo  # noqa: F401  (registers optim="flexdemo")
from hf_flexdemo import FlexDeMo, FlexDeMoConfig
from hf_flexdemo.optim import unwrap_flexdemo
from hf_flexdemo.simulated_replicas import check_simulation_layout
from hf_flexdemo.topology import ReplicaTopology

pytestmark = pytest.mark.unit


def simulated_steps(model, opt, steps: range, replicas: int) -> None:
    for step in steps:
        for replica in range(replicas):
            x, y = batch(replica, 0, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if replica < replicas - 1:
                opt.next_replica()
        opt.step()
        opt.zero_grad()


def test_a_saved_simulation_resumes_exactly():
    """Every replica's momentum travels in the optimizer's state dict: 3 + 3 steps equal 6."""
    torch.manual_seed(0)
    model, resumed_model = OddShapes(), OddShapes()
    resumed_model.load_state_dict(model.state_dict())
    settings = dict(lr=0.01, topk=4, chunk=8, wire=None, simulate_replicas=3, elementwise=[])
    opt = FlexDeMo(model.parameters(), **settings)
    simulated_steps(model, opt, range(3), 3)
    resumed_model.load_state_dict(model.state_dict())
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = FlexDeMo(resumed_model.parameters(), **settings)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    simulated_steps(model, opt, range(3, 6), 3)
    simulated_steps(resumed_model, resumed, range(3, 6), 3)
    for mine, theirs in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(mine, theirs)
    momentum = opt.state[model.lin.weight]["momentum_dct"]
    assert momentum.shape == (3, *model.lin.weight.shape)
    assert not torch.equal(momentum[0], momentum[1]), "replicas' momenta should differ: their data does"


def test_a_step_with_the_wrong_number_of_replicas_is_refused_and_changes_nothing():
    model = OddShapes()
    opt = FlexDeMo(model.parameters(), lr=0.01, simulate_replicas=3, elementwise=[])
    simulated_steps(model, opt, range(1), 3)
    before = [p.detach().clone() for p in model.parameters()]

    def backward():
        x, y = batch(0, 0, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()

    backward()
    opt.next_replica()
    backward()  # replica 1's gradient in .grad: 2 of 3
    with pytest.raises(RuntimeError, match=r"takes 3 replicas' gradients a step, but this step has 2\. .*next_replica"):
        opt.step()
    opt.zero_grad()
    for _ in range(2):  # next_replica() after every backward, of 2 replicas only
        backward()
        opt.next_replica()
    with pytest.raises(RuntimeError, match=r"has 2 \(next_replica\(\) was called 2 times and .grad is empty\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert int(opt.state[model.lin.weight]["step"]) == 1  # the refused steps did not count
    plain = FlexDeMo(model.parameters(), lr=0.01, elementwise=[])
    with pytest.raises(RuntimeError, match="next_replica.. belongs to simulate_replicas"):
        plain.next_replica()


@pytest.mark.lowest
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ("simulate_replicas=2,scheme=diloco", r"simulate_replicas=2 needs replicas that hold one model.*scheme='diloco'"),
        ("simulate_replicas=2,fault_tolerance=torchft", "drop fault_tolerance=torchft, or drop simulate_replicas"),
        ("simulate_replicas=0", "simulate_replicas=0 is invalid"),
    ],
)
def test_settings_that_cannot_simulate_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        FlexDeMoConfig.from_optim_args(settings)


def test_a_real_replicate_group_with_the_simulation_is_refused():
    with pytest.raises(ValueError, match="also has a real replicate group of 2 nodes. Use one or the other"):
        check_simulation_layout([torch.zeros(2)], ReplicaTopology(group=None, size=2, rank=0), 2)


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def trainer(tok, tmp_path, **overrides) -> Trainer:
    settings = dict(
        optim="flexdemo", optim_args="topk=8,chunk=16,simulate_replicas=2", learning_rate=1e-3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4, logging_steps=2,
    )  # fmt: skip
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", **{**settings, **overrides})
    model = tiny_model("llama", len(tok))
    return Trainer(model=model, args=args, train_dataset=dataset("llama", tok, rows=32), data_collator=default_data_collator)


@pytest.mark.lowest
def test_the_trainer_trains_each_part_of_the_accumulation_as_a_replica(tok, tmp_path):
    run = trainer(tok, tmp_path)
    run.train()
    opt = unwrap_flexdemo(run.optimizer)
    matrix = run.model.model.layers[0].mlp.up_proj.weight
    momentum = opt.state[matrix]["momentum_dct"]
    assert momentum.shape == (2, *matrix.shape)
    assert not torch.equal(momentum[0], momentum[1])
    logged = [h for h in run.state.log_history if "flexdemo/bytes_sent" in h]
    assert logged and logged[-1]["flexdemo/bytes_sent"] > 0  # node 0's payload, as on two nodes


@pytest.mark.lowest
def test_an_accumulation_that_does_not_split_into_the_replicas_is_refused(tok, tmp_path):
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 does not split into 2 equal parts.*\(2, 4, 6"):
        trainer(tok, tmp_path, gradient_accumulation_steps=3)


def test_a_trainer_checkpoint_resumes_the_simulation_exactly(tok, tmp_path):
    """Every replica's momentum goes into the Trainer's checkpoint: 2 + 2 steps equal 4, bitwise."""
    whole = trainer(tok, tmp_path / "whole", save_strategy="steps", save_steps=2)
    whole.train()
    resumed = trainer(tok, tmp_path / "resumed", save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    for (name, mine), theirs in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(mine, theirs), name


def test_each_replica_becomes_the_mean_over_its_own_micro_batches_also_on_a_short_step():
    """A short step (3 micro-batches of 4): the Trainer divided each loss by 3; replica 0 had 2, replica 1 had 1."""
    from hf_flexdemo.integrations.simulation import SimulatedSteps

    weight = torch.nn.Parameter(torch.zeros(4, 4))
    opt = FlexDeMo([weight], lr=0.01, simulate_replicas=2, elementwise=[])
    args = TrainingArguments("unused", gradient_accumulation_steps=4, max_grad_norm=0, use_cpu=True, report_to="none")
    steps = SimulatedSteps(opt, args, 2)
    weight.grad = torch.full((4, 4), 2 / 3)  # two micro-batches of gradient 1, each divided by 3
    steps.close_replica(2)
    weight.grad = torch.full((4, 4), 5 / 3)  # one micro-batch of gradient 5
    steps.close_step(args, micro_steps=3, step=1)
    (first,), (second,) = (list(grads.values()) for grads in opt.replica_gradients)
    torch.testing.assert_close(first, torch.ones(4, 4))
    torch.testing.assert_close(second, torch.full((4, 4), 5.0))
    clipped = TrainingArguments("unused", gradient_accumulation_steps=2, max_grad_norm=1.0, use_cpu=True, report_to="none")
    opt.step()
    steps = SimulatedSteps(opt, clipped, 2)
    weight.grad = torch.full((4, 4), 0.5)  # the mean of 1s over 2: the replica's own gradient has norm 4
    steps.close_replica(1)
    weight.grad = torch.full((4, 4), 0.01)
    steps.close_step(clipped, micro_steps=2, step=2)
    norms = [float(torch.linalg.vector_norm(next(iter(g.values())))) for g in opt.replica_gradients]
    assert norms == pytest.approx([1.0, 0.08], rel=1e-5)  # clipped to max_grad_norm on its own; the other not
