"""A user's own Trainer script (tests/workers/user_clm_script.py, no hf_flexdemo import) on the shipped 2 x 2
config through ``-m hf_flexdemo.run``: one launch, whose output folder the tests read.

The config shards the state dict (``SHARDED_STATE_DICT``), under which the stock ``save_model`` writes no
weights: the run must still end with a Hub model that loads and gives the eval loss the run ended with.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from support.fake_hub import FakeHub
from support.faults import small_disk
from support.launch import REPO_ROOT, TESTS_DIR, child_env, free_port, run_checked

from hf_flexdemo.integrations.trainer import TRANSFORMERS_MAJOR

SCRIPT = TESTS_DIR / "workers" / "user_clm_script.py"
CONFIG = REPO_ROOT / "accelerate_configs" / "cpu_2x2.yaml"
STEPS = 4
PRESET = "2bit"
EVAL_BATCH = 4
REPO = "test-user/user-clm"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict[str, bytes], str]:
    """The output folder, the files the run pushed to a stand-in Hub, and what the run printed (every warning
    shown: ``PYTHONWARNINGS=default``)."""
    root = tmp_path_factory.mktemp("user_script")
    out = root / "out"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
        "--main_process_port", str(free_port()), "-m", "hf_flexdemo.run", str(SCRIPT),
        "--optim", "flexdemo", "--optim_args", f"wire={PRESET}", "--output_dir", str(out),
        "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--per_device_eval_batch_size",
        str(EVAL_BATCH), "--logging_steps", "2", "--save_strategy", "steps", "--save_steps", str(STEPS),
        "--report_to", "none", "--learning_rate", "1e-3", "--push_to_hub", "--hub_model_id", REPO,
        "--hub_strategy", "end",
    ]  # fmt: skip
    with FakeHub() as hub:
        env = hub.env(child_env(HF_HOME=str(root / "hf_home"), PYTHONWARNINGS="default"))
        proc = run_checked(command, timeout=600, env=env)
        return out, hub.files(REPO), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def run(launched) -> Path:
    return launched[0]


def script_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_clm_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_the_output_folder_holds_a_hub_model_and_the_checkpoint_stays_sharded(run):
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (run / name).is_file(), sorted(p.name for p in run.iterdir())
    assert not (run / ".flexdemo_saving").exists()
    checkpoint = run / f"checkpoint-{STEPS}"
    assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()  # resume state: a sharded checkpoint
    # transformers 4.x's own checkpoint save also writes the gathered weights beside the shards; 5.x does not
    assert (checkpoint / "model.safetensors").exists() == (TRANSFORMERS_MAJOR < 5)


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_the_saved_model_loads_and_gives_the_eval_loss_the_run_ended_with(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run).eval()
    tok = AutoTokenizer.from_pretrained(run)
    module = script_module()
    _, eval_data = module.splits(tok, module.DataArguments())
    # Every block has the same number of labelled tokens, so the mean over batches is the mean over blocks.
    # transformers 4.x's evaluation divides the summed token losses by every label, the first of each block too,
    # which the shifted loss never predicts (5.x counts the shifted labels): its loss is the model's times 31/32.
    block = module.DataArguments().block_size
    counted = 1.0 if TRANSFORMERS_MAJOR >= 5 else (block - 1) / block
    losses = []
    with torch.no_grad():
        for start in range(0, len(eval_data), EVAL_BATCH):
            batch = eval_data[start : start + EVAL_BATCH]
            ids = torch.tensor(batch["input_ids"])
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.item()
            losses.append(loss * counted)
    ended_with = json.loads((run / "eval_results.json").read_text())["eval_loss"]
    assert sum(losses) / len(losses) == pytest.approx(ended_with, rel=1e-5)
    trained_for = json.loads((run / "trainer_state.json").read_text())["global_step"]
    assert trained_for == STEPS


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_push_to_hub_pushes_the_model_that_loads(launched, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, pushed, _ = launched
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md"):
        assert name in pushed, sorted(pushed)
    for name, content in pushed.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    AutoModelForCausalLM.from_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tmp_path)
    local, hub = load_file(out / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert local.keys() == hub.keys() and all(torch.equal(local[k], hub[k]) for k in local)


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_the_merge_command_the_warning_gives_rebuilds_the_same_model(run, tmp_path):
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    merge_fsdp_weights(str(run / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0"), str(tmp_path))
    merged, saved = load_file(tmp_path / "model.safetensors"), load_file(run / "model.safetensors")
    assert merged.keys() == saved.keys()
    for name in saved:
        assert torch.equal(merged[name], saved[name]), name


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_the_model_card_names_the_preset(run):
    card = (run / "README.md").read_text()
    assert f"wire='{PRESET}'" in card and "FlexDeMo(" in card and "2 nodes x 2 processes" in card, card


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_the_logged_ratio_is_the_wire_tables_on_the_same_shapes(run):
    """Node 0's logged bytes equal README's wire table (benchmarks/quality/wire_presets.py) on the shards that
    node 0's two processes hold; the baseline is the dense bf16 all-reduce (2 bytes per parameter)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "quality"))
    from transformers import AutoModelForCausalLM
    from wire_presets import dense_bytes, preset_bytes

    from hf_flexdemo.optim.counters import x_fewer_than_bf16_dense

    shapes = [p.shape for p in AutoModelForCausalLM.from_pretrained(run).parameters()]
    # FSDP2 shards dim 0 over the node's 2 processes as torch.chunk does.
    shards = [torch.Size([len(c), *shape[1:]]) for shape in shapes for c in torch.empty(shape[0]).chunk(2)]
    logged = [h for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h][-1]
    assert logged["flexdemo/bytes_sent_per_step"] == preset_bytes(shards, PRESET)
    assert logged["flexdemo/dense_bytes"] == dense_bytes(shapes) * logged["step"]
    assert logged["flexdemo/dense_bytes"] == sum(s.numel() for s in shapes) * 2 * logged["step"]
    table = x_fewer_than_bf16_dense(preset_bytes(shards, PRESET), dense_bytes(shapes))
    assert logged["flexdemo/x_fewer_than_bf16_dense"] == pytest.approx(table, rel=1e-12)
    assert "compression_ratio" not in " ".join(logged)


@pytest.mark.lowest
@pytest.mark.multiprocess
def test_flexdemo_shards_over_the_meshs_own_dp_shard_and_logs_its_bytes_at_every_step_logged(launched):
    # No rank slices a flattened dimension (torch warns where one does).
    run, _, output = launched
    assert "Slicing a flattened dim" not in output
    logged = [h for h in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(logged) == STEPS // 2 and all("flexdemo/bytes_sent" in h for h in logged)


# -- in one process ------------------------------------------------------------------------


@pytest.mark.unit
def test_bad_optim_args_are_refused_before_the_script_touches_its_data(tmp_path, monkeypatch):
    """``-m hf_flexdemo.run script.py --optim_args topk=0``: refused while the script parses its arguments."""
    import datasets

    from hf_flexdemo import run as flexdemo_run

    loads = []
    original = datasets.Dataset.from_dict
    monkeypatch.setattr(datasets.Dataset, "from_dict", lambda *a, **k: loads.append(1) or original(*a, **k))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"topk=0 is invalid; topk must be an integer in \[1, 4096\]"):
        flexdemo_run.main(
            [str(SCRIPT), "--optim", "flexdemo", "--optim_args", "topk=0", "--output_dir", str(tmp_path), "--use_cpu"]
        )
    assert loads == [] and time.perf_counter() - started < 10
    assert not any(tmp_path.iterdir())


@pytest.mark.unit
def test_a_model_too_large_for_rank_0_gets_the_merge_command(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_flexdemo.integrations.checkpoints import write_marker
    from hf_flexdemo.integrations.final_model import fits_in_memory, parameter_bytes, too_big_message

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))  # fmt: skip
    size = parameter_bytes(model)
    assert size == sum(p.numel() * 4 for p in model.parameters())
    assert fits_in_memory(model, available=2 * size) and not fits_in_memory(model, available=size)
    checkpoint = tmp_path / "checkpoint-7"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    write_marker(checkpoint, 7)
    message = too_big_message(model, tmp_path, tmp_path, available=size)
    assert f"`accelerate merge-weights {checkpoint / 'pytorch_model_fsdp_0'} {tmp_path}`" in message, message
    assert "wrote only the config and the tokenizer" in message
    assert "--save_strategy steps" in too_big_message(model, tmp_path / "elsewhere", tmp_path / "elsewhere", size)


@pytest.mark.unit
def test_the_merge_command_exists_in_the_installed_accelerate():
    """The command the too-large warning gives, as the `accelerate` console script parses it."""
    import argparse

    from accelerate.commands.merge import merge_command_parser

    commands = argparse.ArgumentParser().add_subparsers()
    merge_command_parser(commands)
    parsed = commands._name_parser_map["merge-weights"].parse_args(["checkpoint-7/pytorch_model_fsdp_0", "out"])
    assert (parsed.checkpoint_directory, parsed.output_path) == ("checkpoint-7/pytorch_model_fsdp_0", "out")


@pytest.mark.faults
def test_a_full_disk_fails_with_the_path_and_leaves_the_earlier_model_whole(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_flexdemo.integrations.checkpoints import CheckpointStorageError, storage_cause
    from hf_flexdemo.integrations.final_model import storage_message, write_model

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4))  # fmt: skip
    with small_disk(4) as disk:
        if disk is None:
            pytest.skip("mounting a small tmpfs needs root and mount(8)")
        target = disk / "model"
        write_model(model, model.state_dict(), target)
        before = (target / "model.safetensors").read_bytes()
        filler = disk / "filler"
        with filler.open("wb") as out:  # leave less than the model's size free
            out.write(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - len(before) // 2))
        with pytest.raises(Exception) as raised:  # safetensors' own error class, which says ENOSPC
            write_model(model, {k: v + 1 for k, v in model.state_dict().items()}, target)
        cause = storage_cause(raised.value, target)
        assert cause is not None and cause.startswith("the disk is full"), raised.value
        assert (target / "model.safetensors").read_bytes() == before
        assert not (target / ".flexdemo_saving").exists()
        message = storage_message(target, tmp_path, cause)
        assert str(target.resolve()) in message and "the disk is full" in message
        assert issubclass(CheckpointStorageError, OSError)


@pytest.mark.faults
def test_save_model_into_a_read_only_folder_names_it_and_the_reason(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from hf_flexdemo.integrations.checkpoints import CheckpointStorageError

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))  # fmt: skip
    args = TrainingArguments(str(tmp_path), optim="flexdemo", use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args)  # another optimizer's save_model is the stock one
    with small_disk(1, read_only=True) as disk:
        if disk is None:
            pytest.skip("mounting a read-only tmpfs needs root and mount(8)")
        expected = rf"{re.escape(str(disk / 'model'))}.*cannot be written.*Read-only file system"
        with pytest.raises(CheckpointStorageError, match=expected):
            trainer.save_model(str(disk / "model"))
