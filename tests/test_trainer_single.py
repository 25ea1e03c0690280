"""Trainer integration checks that need one process: registration, validation, launcher."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.launch import TESTS_DIR, child_env, torchrun
from support.tiny_hf import dataset, tiny_model, tokenizer
from transformers import HfArgumentParser, Trainer, TrainingArguments, default_data_collator

import hf_flexdemo
from hf_flexdemo.integrations.trainer import flexdemo_kwargs, mark_mean_loss_model


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.mark.lowest
def test_optim_flexdemo_parses_from_the_command_line():
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            "out",
            "--optim",
            "flexdemo",
            "--optim_args",
            "scheme=random,rate=1/64",
            "--learning_rate",
            "2e-4",
        ]
    )
    kwargs = flexdemo_kwargs(args)
    assert (kwargs["scheme"], kwargs["rate"], kwargs["lr"]) == ("random", 1 / 64, 2e-4)


@pytest.mark.lowest
@pytest.mark.parametrize(
    "optim_args,message",
    [
        ("topk=0", "topk=0 is invalid; topk must be an integer in [1, 4096]"),
        ("topk=8,colour=red", "unknown key 'colour'"),
        ("scheme=adam", "scheme='adam' is invalid"),
        ("topk", "not of the form key=value"),
        ("lr=0.1", "--learning_rate"),
    ],
)
def test_bad_optim_args_fail_when_the_training_arguments_are_built(tmp_path, optim_args, message):
    # Before a script loads any data: every Hugging Face script parses TrainingArguments first.
    with pytest.raises(ValueError) as err:
        TrainingArguments(str(tmp_path), optim="flexdemo", optim_args=optim_args, use_cpu=True, report_to="none")
    assert message in str(err.value)


@pytest.mark.lowest
def test_flexdemo_settings_with_another_optimizer_are_refused(tmp_path):
    expected = r"sets FlexDeMo's \['scheme', 'topk'\], but optim='adamw_torch'.*--optim flexdemo"
    with pytest.raises(ValueError, match=expected):
        TrainingArguments(
            str(tmp_path), optim="adamw_torch", optim_args="topk=32,scheme=demo", use_cpu=True, report_to="none"
        )
    with pytest.raises(ValueError, match=r"sets FlexDeMo's \['shared_indices'\], but optim='adamw_torch'"):  # removed
        TrainingArguments(str(tmp_path), optim="adamw_torch", optim_args="shared_indices=true", report_to="none")


def flexdemo_llama_trainer(tok, tmp_path, rows: int, **overrides) -> Trainer:
    """The stock Trainer on a tiny Llama, one CPU process, FlexDeMo with small tiles."""
    settings = dict(optim="flexdemo", optim_args="topk=8,chunk=16", learning_rate=1e-3, per_device_train_batch_size=8)
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", **{**settings, **overrides})
    return Trainer(
        model=tiny_model("llama", len(tok)),
        args=args,
        train_dataset=dataset("llama", tok, rows=rows),
        data_collator=default_data_collator,
    )


@pytest.mark.lowest
def test_orthogonal_update_leaves_embeddings_and_head_to_the_elementwise_rule(tok, tmp_path):
    elementwise = "adam"
    trainer = flexdemo_llama_trainer(tok, tmp_path, rows=64, max_steps=8, logging_steps=1, optim_args="topk=8,chunk=16")
    trainer.train()
    opt, model = trainer.optimizer.optimizer, trainer.model
    by_rule = {
        rule: {id(p) for g in opt.param_groups if g["update"] == rule for p in g["params"]}
        for rule in (elementwise, "orthogonal")
    }
    assert {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)} <= by_rule[elementwise]
    matrices = [p for p in model.parameters() if p.dim() == 2 and id(p) in by_rule["orthogonal"]]
    assert len(matrices) >= 4 and not by_rule[elementwise] & by_rule["orthogonal"]  # attention and MLP weights
    assert {g["update"] for g in opt.param_groups} == {elementwise, "orthogonal"}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-2:]) < sum(losses[:2]), losses


def test_a_wire_preset_in_optim_args_sets_every_groups_tiles(tok, tmp_path):
    """``wire=top64_1bit`` sets topk in each group the Trainer builds (weight decay splits them)."""
    from hf_flexdemo.optim import unwrap_flexdemo

    trainer = flexdemo_llama_trainer(tok, tmp_path, rows=8, optim_args="wire=top64_1bit", weight_decay=0.1)
    opt = unwrap_flexdemo(trainer.create_optimizer())
    assert len(opt.param_groups) >= 2 and opt.config.index_coding == "elias_fano" and opt.config.value_bits == 1
    assert {(g["chunk"], g["topk"]) for g in opt.param_groups} == {(64, 64)}


@pytest.mark.lowest
def test_an_output_dir_that_cannot_be_written_is_refused_when_the_trainer_is_built(tok, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = TrainingArguments(str(blocker / "run"), optim="flexdemo", use_cpu=True, report_to="none")
    with pytest.raises(OSError, match=r"output_dir=.*cannot be written.*choose a writable --output_dir"):
        Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=8))


@pytest.mark.lowest
def test_single_process_trainer_trains_with_flexdemo(tok, tmp_path):
    trainer = flexdemo_llama_trainer(tok, tmp_path, rows=64, max_steps=12, logging_steps=1, save_strategy="no")
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, hf_flexdemo.FlexDeMo)
    assert trainer.optimizer.optimizer.topology.size == 1
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(loss[-3:]) < sum(loss[:3])


def test_epoch_checkpoints_hold_every_update_with_overlap(tok, tmp_path):
    """Epoch saves come after on_step_end: the pending late update must land before the weights are written."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class LiveWeightsAtSave(TrainerCallback):
        def __init__(self):
            self.weights = {}

        def on_save(self, args, state, control, model=None, **kw):
            self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    trainer = flexdemo_llama_trainer(
        tok,
        tmp_path,
        rows=16,
        optim_args="topk=8,chunk=16,overlap=true",
        num_train_epochs=2,
        save_strategy="epoch",
    )
    live = LiveWeightsAtSave()
    trainer.add_callback(live)
    trainer.train()
    assert sorted(live.weights) == [2, 4]
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(tensor, live.weights[2][name]), name


@pytest.mark.lowest
def test_flexdemos_callbacks_come_after_the_defaults_and_before_the_reporters_once(tok, tmp_path):
    """Added through the Trainer's own callback list (no library registry written); one the user passed is moved
    there, not doubled."""
    from transformers.integrations import WandbCallback
    from transformers.trainer import DEFAULT_CALLBACKS

    from hf_flexdemo.integrations.callback import FlexDeMoCallback
    from hf_flexdemo.integrations.checkpoints import CheckpointCallback

    mine = FlexDeMoCallback(check_every=5)
    args = TrainingArguments(str(tmp_path), optim="flexdemo", use_cpu=True, report_to="wandb")
    trainer = Trainer(model=tiny_model("llama", len(tok)), args=args, callbacks=[mine])
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    defaults = len(DEFAULT_CALLBACKS)
    assert kinds[:defaults] == list(DEFAULT_CALLBACKS)
    assert kinds[defaults : defaults + 3] == [FlexDeMoCallback, CheckpointCallback, WandbCallback]
    assert kinds.count(FlexDeMoCallback) == 1 and trainer.callback_handler.callbacks[defaults] is mine
    assert FlexDeMoCallback not in DEFAULT_CALLBACKS


def test_t5_family_is_marked_as_averaging_its_own_loss(tok):
    t5, llama = tiny_model("t5", len(tok)), tiny_model("llama", len(tok))
    assert mark_mean_loss_model(t5) and t5.accepts_loss_kwargs is False
    assert not mark_mean_loss_model(llama) and not hasattr(llama, "accepts_loss_kwargs")


def fake_state(**overrides):
    """An AcceleratorState-like object: a valid FSDP2 2 x 2 layout unless overridden."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(fsdp_version=2, sharding_strategy=None)
    layout = SimpleNamespace(total_size=4, dp_replicate_size=2, dp_shard_size=2)
    base = dict(
        num_processes=4,
        distributed_type=DistributedType.FSDP,
        fsdp_plugin=plugin,
        mixed_precision="no",
        parallelism_config=layout,
    )
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(fsdp_plugin=SimpleNamespace(fsdp_version=1)), "FSDP version 1 is not supported: set `fsdp_config"),
        (dict(distributed_type="MULTI_GPU", fsdp_plugin=None), "would all-reduce every gradient densely"),
        (dict(fsdp_plugin=SimpleNamespace(fsdp_version=2, sharding_strategy="NO_SHARD")), "NO_SHARD is an FSDP1"),
        (dict(mixed_precision="fp16"), "mixed_precision='fp16' is refused"),
        (dict(num_processes=2), "dp_shard 2 = 4 processes, but this launch started 2"),
    ],
)
def test_layouts_flexdemo_cannot_train_are_refused_with_what_to_write_instead(overrides, message):
    from hf_flexdemo.integrations.accelerate_plugin import check_flexdemo_layout

    check_flexdemo_layout(fake_state())  # the valid layout passes
    with pytest.raises(ValueError, match=re.escape(message)):
        check_flexdemo_layout(fake_state(**overrides))


def test_launcher_without_a_script_prints_usage():
    proc = subprocess.run([sys.executable, "-m", "hf_flexdemo.run"], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 2 and "accelerate launch" in proc.stdout


UNSYNCHRONIZED_LAYOUTS = {
    "fsdp1": "FSDP version 1 is refused on CPU",
    "fsdp1_sync_module_states": "FSDP version 1 is refused on CPU",
    "ddp": "FlexDeMo needs FSDP2 inside each node",
}


@pytest.fixture(scope="module")
def refused_layouts(tmp_path_factory) -> Path:
    """Every case of UNSYNCHRONIZED_LAYOUTS in turn, in one launch of 2 processes."""
    out = tmp_path_factory.mktemp("refused_layouts")
    torchrun(TESTS_DIR / "workers" / "accelerate_refusals.py", 2, ",".join(UNSYNCHRONIZED_LAYOUTS), str(out))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("case,message", UNSYNCHRONIZED_LAYOUTS.items())
def test_layouts_that_would_train_unsynchronized_are_refused(refused_layouts, case, message):
    for rank in range(2):
        text = (refused_layouts / f"rank{rank}_{case}.txt").read_text()
        assert message in text, text
        assert "fsdp_version: 2" in text, text  # says what to write instead


def test_a_shard_size_of_one_under_fsdp_is_refused_with_the_layout_that_works():
    from accelerate.parallelism_config import ParallelismConfig

    from hf_flexdemo.integrations.accelerate_plugin import _refuse_fsdp_without_a_shard_dimension

    with pytest.raises(ValueError, match="remove `parallelism_config` from the Accelerate config"):
        _refuse_fsdp_without_a_shard_dimension(object(), ParallelismConfig(dp_replicate_size=2, dp_shard_size=1))
    _refuse_fsdp_without_a_shard_dimension(object(), ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    _refuse_fsdp_without_a_shard_dimension(None, ParallelismConfig(dp_replicate_size=2, dp_shard_size=1))


def test_uneven_nodes_and_model_parallel_sizes_are_refused_with_what_to_write(monkeypatch):
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from hf_flexdemo.integrations.accelerate_plugin import _ensure_layout, default_layout

    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4.*same --num_processes"):
        default_layout()
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert default_layout() == (2, 4)
    accelerator = SimpleNamespace(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with pytest.raises(ValueError, match="(?s)also sets tp/cp/sp.*Set the tp, cp and sp sizes to 1"):
        _ensure_layout(accelerator)


def test_the_trainer_reads_flexdemos_settings_once(tok, tmp_path, monkeypatch):
    from hf_flexdemo.integrations import training_args

    parsed = []
    original = training_args.parse_optim_args
    monkeypatch.setattr(training_args, "parse_optim_args", lambda text: parsed.append(text) or original(text))
    training_args._settings.cache_clear()
    trainer = flexdemo_llama_trainer(tok, tmp_path, rows=16, max_steps=2, save_strategy="no", optim_args="topk=7")
    trainer.train()
    assert parsed == ["topk=7"]
    trainer.args.optim_args = "topk=6"  # a script that changes its arguments is read again
    assert training_args.flexdemo_config(trainer.args).topk == 6 and parsed == ["topk=7", "topk=6"]
