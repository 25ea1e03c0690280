"""What a new user meets on a first run, in one process: the scripts' summary and defaults, --bf16 on CPU."""

from __future__ import annotations

import pytest
import torch
from script_utils import parse_arguments, print_summary
from support.tiny_hf import dataset, tiny_model, tokenizer
from train_t5 import COMMON, PRESETS, T5Arguments
from transformers import Seq2SeqTrainingArguments, Trainer, TrainingArguments

import hf_flexdemo  # noqa: F401  (optim="flexdemo")
from hf_flexdemo.integrations.trainer import describe

pytestmark = pytest.mark.unit


def test_one_node_says_nothing_crosses_nodes_and_lists_only_the_settings_that_act(tmp_path, capsys):
    tok = tokenizer()
    args = TrainingArguments(
        str(tmp_path), optim="flexdemo", optim_args="topk=8,chunk=16", use_cpu=True, max_steps=1,
        per_device_train_batch_size=2, report_to="none", save_strategy="no", dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = Trainer(model=tiny_model("llama", len(tok)), args=args, train_dataset=dataset("llama", tok, rows=4))
    trainer.train()
    print_summary(trainer, {}, [])
    out = capsys.readouterr().out
    assert "nothing crosses nodes" in out and "inf" not in out and "0 B" not in out, out
    assert "update='orthogonal'" in describe(args) and "sign=" not in describe(args), describe(args)


@pytest.mark.parametrize("flags,pinned", [([], torch.accelerator.is_available()), (["--dataloader_pin_memory"], True)])
def test_the_scripts_pin_memory_only_with_an_accelerator(tmp_path, flags, pinned):
    argv = ["--preset", "offline", "--output_dir", str(tmp_path), *flags]
    _, training_args = parse_arguments((T5Arguments, Seq2SeqTrainingArguments), PRESETS, COMMON, argv)
    assert training_args.dataloader_pin_memory is pinned


@pytest.mark.lowest
@pytest.mark.skipif(torch.accelerator.is_available(), reason="bf16 on a machine without an accelerator")
def test_bf16_without_an_accelerator_trains_on_the_cpu_instead_of_failing(tmp_path):
    # transformers alone: "Your setup doesn't support bf16/gpu", raised by every process of a launch. Other
    # optimizers keep that (tests/test_other_optimizers.py).
    args = TrainingArguments(str(tmp_path), optim="flexdemo", bf16=True, report_to="none")
    assert args.bf16 and args.use_cpu
