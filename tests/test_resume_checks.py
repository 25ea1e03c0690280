"""A checkpoint checked against the run that resumes it: another model is refused, a finished run ends.

Checkpoints are written here the way the Trainer and Accelerate write them (``config.json``,
a distributed checkpoint of ``{"model": state_dict}``, ``trainer_state.json``); one test
relaunches a finished single-process Trainer run.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.tiny_hf import dataset, tiny_model, tokenizer
from transformers import Trainer, TrainingArguments

import hf_flexdemo  # noqa: F401  (the Trainer glue)
from hf_flexdemo.config import DEFAULT_WIRE, OLD_DEFAULT_WIRE
from hf_flexdemo.integrations.resume import (
    MODEL_FOLDER,
    check_checkpoint_model,
    check_saved_settings,
    saved_optim_args,
    settle_wire,
    stop_if_complete,
)
from hf_flexdemo.optim import unwrap_flexdemo

pytestmark = pytest.mark.unit


def sharded_checkpoint(folder, model, model_type: str | None = None):
    """What Accelerate's FSDP save leaves: the model's tensors under "model." in a distributed checkpoint."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / MODEL_FOLDER), no_dist=True)
    if model_type:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def test_another_models_checkpoint_is_refused_naming_both(tmp_path):
    checkpoint = sharded_checkpoint(tmp_path, tiny_model("olmo2", 64), "olmo2")
    with pytest.raises(ValueError, match=r"type 'olmo2', and this run trains one of type 't5'.*another --output_dir"):
        check_checkpoint_model(checkpoint, tiny_model("t5", 64))


def test_a_checkpoint_without_its_config_is_checked_by_tensor_names_and_shapes(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    olmo2 = sharded_checkpoint(tmp_path / "a", tiny_model("olmo2", 64))
    with pytest.raises(ValueError, match=r"has \d+ tensors the checkpoint lacks, such as decoder\."):
        check_checkpoint_model(olmo2, tiny_model("t5", 64))
    bigger_vocabulary = sharded_checkpoint(tmp_path / "b", tiny_model("t5", 96), "t5")
    with pytest.raises(ValueError, match=r"other shapes .* \(saved \[96, 64\], this run \[64, 64\]\)"):
        check_checkpoint_model(bigger_vocabulary, tiny_model("t5", 64))


def test_the_same_models_checkpoint_passes(tmp_path):
    check_checkpoint_model(sharded_checkpoint(tmp_path, tiny_model("t5", 64), "t5"), tiny_model("t5", 64))


@pytest.mark.parametrize(
    "saved,args,ended,complete",
    [
        (dict(global_step=4, epoch=0.5), dict(max_steps=4, num_train_epochs=3), True, True),
        (dict(global_step=4, epoch=0.5), dict(max_steps=4, num_train_epochs=3), False, False),  # stopped before its end
        (dict(global_step=4, epoch=0.5), dict(max_steps=6, num_train_epochs=3), True, False),
        (dict(global_step=30, epoch=3.0), dict(max_steps=-1, num_train_epochs=3), True, True),
        (dict(global_step=30, epoch=3.0), dict(max_steps=-1, num_train_epochs=4), True, False),
    ],
)
def test_a_run_that_reached_its_end_ends_at_once(tmp_path, capsys, saved, args, ended, complete):
    checkpoint = tmp_path / "checkpoint-x"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps(saved))
    if ended:  # trainer.save_state() after train(), as the scripts do
        (tmp_path / "trainer_state.json").write_text(json.dumps(saved))
    args = SimpleNamespace(output_dir=str(tmp_path), **args)
    if not complete:
        stop_if_complete(checkpoint, args)
        return
    with pytest.raises(SystemExit) as stopped:
        stop_if_complete(checkpoint, args)
    assert stopped.value.code == 0
    assert "this run is complete" in capsys.readouterr().out


def test_a_relaunched_finished_run_trains_and_writes_nothing(tmp_path):
    tok = tokenizer()
    args = TrainingArguments(
        str(tmp_path), optim="flexdemo", optim_args="topk=8,chunk=16", use_cpu=True, max_steps=2, save_steps=2,
        per_device_train_batch_size=2, report_to="none", dataloader_pin_memory=False,
    )  # fmt: skip
    first = Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=8))
    first.train()
    first.save_state()  # the end of a script's run
    before = sorted(p.name for p in tmp_path.iterdir())
    relaunch = Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=8))
    with pytest.raises(SystemExit) as stopped:
        relaunch.train()
    assert stopped.value.code == 0 and relaunch.state.global_step == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before == ["checkpoint-2", "trainer_state.json"]


def saved_args(folder, optim_args: str, optim: str = "flexdemo"):
    """A checkpoint's ``training_args.bin`` as the Trainer pickles it, from a run launched with ``optim_args``
    (written after construction: an older version took settings this one refuses)."""
    folder.mkdir(exist_ok=True)
    args = TrainingArguments(str(folder), optim=optim, use_cpu=True, report_to="none")
    args.optim_args = optim_args
    torch.save(args, folder / "training_args.bin")
    return folder


@pytest.mark.parametrize(
    "optim_args, removed",
    [
        ("topk=32,topk_block=2", "topk_block was removed"),
        ("scheme=lowrank,factor_rank=2", "scheme=lowrank was removed"),
        ("update=orthogonal, ns_steps=4", "ns_steps was removed"),
    ],
)
def test_a_checkpoint_trained_with_a_removed_setting_is_refused_saying_why_and_where(tmp_path, optim_args, removed):
    checkpoint = saved_args(tmp_path / "checkpoint-4", optim_args)
    with pytest.raises(ValueError) as refused:
        check_saved_settings(checkpoint)
    message = str(refused.value)
    assert message.startswith(f"Resuming from {checkpoint} is refused: it was trained with ") and removed in message
    assert "BENCHMARKS.md, 'Findings: options taken out'" in message and "commit 17d8727" in message


def test_a_checkpoint_of_kept_settings_or_of_another_optimizer_passes(tmp_path):
    check_saved_settings(saved_args(tmp_path / "checkpoint-1", "wire=2bit,topk=32"))
    check_saved_settings(saved_args(tmp_path / "checkpoint-2", "topk_block=2", optim="adamw_torch"))
    check_saved_settings(tmp_path / "checkpoint-3")  # nothing saved there: nothing to check


def test_resuming_a_checkpoint_of_a_removed_setting_is_refused_before_anything_loads(tmp_path):
    tok = tokenizer()
    args = TrainingArguments(
        str(tmp_path), optim="flexdemo", optim_args="topk=8,chunk=16", use_cpu=True, max_steps=1, save_steps=1,
        per_device_train_batch_size=2, report_to="none", dataloader_pin_memory=False,
    )  # fmt: skip
    Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=4)).train()
    saved_args(tmp_path / "checkpoint-1", "topk=8,chunk=16,decode=mean")  # as a run of 17d8727 saved it
    args.max_steps = 2
    resumed = Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=4))
    with pytest.raises(ValueError, match=r"checkpoint-1 is refused: it was trained with decode=mean, and decode was"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 0


def wire_run(tmp_path, optim_args: str, max_steps: int, **overrides) -> Trainer:
    tok = tokenizer()
    args = TrainingArguments(
        str(tmp_path), optim="flexdemo", optim_args=optim_args, use_cpu=True, max_steps=max_steps, save_steps=2,
        per_device_train_batch_size=2, report_to="none", dataloader_pin_memory=False, learning_rate=1e-3,
        **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=16))


def test_a_fresh_run_that_names_no_wire_records_the_default_in_every_checkpoint(tmp_path):
    run = wire_run(tmp_path, "update=orthogonal", max_steps=2)
    run.train()
    assert run.args.optim_args == f"update=orthogonal,wire={DEFAULT_WIRE}"
    assert saved_optim_args(tmp_path / "checkpoint-2") == f"update=orthogonal,wire={DEFAULT_WIRE}"
    assert unwrap_flexdemo(run.optimizer).config.wire == DEFAULT_WIRE


def test_a_checkpoint_of_the_old_default_resumes_with_its_own_wire_bitwise(tmp_path):
    """A run launched before the default changed named no wire and trained DeMo's: resumed by this version with the
    same optim_args, it goes on with DeMo's wire and ends where the uninterrupted run does."""
    whole = wire_run(tmp_path / "whole", f"update=orthogonal,wire={OLD_DEFAULT_WIRE}", max_steps=4)
    whole.train()
    saved_args(tmp_path / "whole" / "checkpoint-2", "update=orthogonal")  # as the old version saved it: no wire named
    resumed = wire_run(tmp_path / "resumed", "update=orthogonal", max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.args.optim_args == f"update=orthogonal,wire={OLD_DEFAULT_WIRE}"
    assert unwrap_flexdemo(resumed.optimizer).config.topk == 32
    for (name, mine), theirs in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(mine, theirs), name


def test_a_resume_that_would_switch_the_wire_is_refused_naming_both(tmp_path):
    wire_run(tmp_path, "update=orthogonal", max_steps=2).train()  # records the default wire
    resumed = wire_run(tmp_path, "update=orthogonal,wire=2bit", max_steps=4)
    with pytest.raises(ValueError) as refused:
        resumed.train(resume_from_checkpoint=True)
    message = str(refused.value)
    assert f"it was trained with wire={DEFAULT_WIRE}, and this run asks for wire=2bit" in message
    assert f"Resume with wire={DEFAULT_WIRE} in optim_args" in message
    assert resumed.state.global_step == 0


def test_a_checkpoints_wire_is_read_without_the_settings_of_its_machine(tmp_path):
    """A checkpoint of a GPU node (kernels=triton) resumed on a CPU: only the settings that decide the wire are read."""
    checkpoint = saved_args(tmp_path / "checkpoint-4", "kernels=triton,update=orthogonal")
    args = SimpleNamespace(optim_args="update=orthogonal")
    settle_wire(args, checkpoint)
    assert args.optim_args == f"update=orthogonal,wire={OLD_DEFAULT_WIRE}"


def test_a_chunk_given_keeps_the_knobs_as_given():
    """The default's 128 coefficients are measured on 64 x 64 tiles: a run that sets its tiles sets its wire."""
    from hf_flexdemo import FlexDeMoConfig

    assert (FlexDeMoConfig(chunk=8).wire, FlexDeMoConfig(chunk=8).topk) == (None, 32)
    assert FlexDeMoConfig().wire == DEFAULT_WIRE
