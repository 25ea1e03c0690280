"""The package alone: ``pip install -e .`` brings torch, transformers and accelerate, nothing the scripts use.

Run by ``make test-lean`` in ``.venv-lean``, which holds the package and pytest only; the other venvs hold every
extra, so there the test is skipped.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_flexdemo  # noqa: F401  (registers optim="flexdemo")

pytestmark = [
    pytest.mark.lean,
    pytest.mark.skipif(
        os.environ.get("FLEXDEMO_LEAN_VENV") != "1", reason="runs in the venv with the package alone (make test-lean)"
    ),
]

EXTRAS_ONLY = ("datasets", "evaluate", "wandb", "sacrebleu", "polib", "django", "sklearn", "PIL", "torchft")


def test_the_install_brings_none_of_the_scripts_libraries():
    assert [name for name in EXTRAS_ONLY if importlib.util.find_spec(name) is not None] == []


class Tokens(torch.utils.data.Dataset):
    """Random token blocks: a causal LM's training data with no datasets library."""

    def __init__(self, rows: int = 16, length: int = 16, vocab: int = 64):
        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_the_stock_trainer_trains_two_steps_with_flexdemo(tmp_path):
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    args = TrainingArguments(
        str(tmp_path), optim="flexdemo", optim_args="topk=8,chunk=16", max_steps=2, per_device_train_batch_size=4,
        use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert type(trainer.optimizer.optimizer).__name__ == "FlexDeMo"
