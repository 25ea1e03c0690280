"""A user's plain AdamW Trainer script, run with and without ``import hf_flexdemo`` (tests/test_other_optimizers.py).

    python adamw_trainer_script.py OUT_DIR REPORT.json [--import-hf-flexdemo]

The user's report of issue 71: 4 steps with ``--save_steps 2``, then the same script again with ``max_steps`` 6 in
the same ``output_dir`` (stock transformers starts over and writes checkpoint-6). Also: what ``bf16=True`` does
on this machine, and what the Trainer does to a T5 model. The report holds what the two runs must share.
"""

import json
import sys
from pathlib import Path

if "--import-hf-flexdemo" in sys.argv:
    import hf_flexdemo  # noqa: F401  (the user's one added line)

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
    set_seed,
)

VOCAB, LENGTH, ROWS = 64, 16, 32


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=LENGTH, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def rows() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (ROWS, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(out: Path, **overrides) -> TrainingArguments:
    settings = dict(
        optim="adamw_torch", max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1, seed=0,
        per_device_train_batch_size=4, use_cpu=True, report_to="none", dataloader_pin_memory=False,
    )  # fmt: skip
    return TrainingArguments(str(out), **{**settings, **overrides})


def train(out: Path, max_steps: int) -> dict:
    """One launch of the user's script; a refusal is reported, not raised, so that both sides can be compared."""
    set_seed(0)
    trainer = Trainer(model=tiny_llama(), args=arguments(out, max_steps=max_steps), train_dataset=rows())
    callbacks = [type(callback).__name__ for callback in trainer.callback_handler.callbacks]
    try:
        trainer.train()
    except Exception as error:  # the old hf_flexdemo refused the second run here
        return {"callbacks": callbacks, "raised": f"{type(error).__name__}: {error}"}
    trainer.save_model()
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return {"callbacks": callbacks, "global_step": trainer.state.global_step, "losses": losses}


def bf16_on_this_machine(out: Path) -> dict:
    try:
        args = TrainingArguments(str(out), optim="adamw_torch", bf16=True, report_to="none")
    except Exception as error:
        return {"raised": type(error).__name__}
    return {"use_cpu": args.use_cpu}


def t5_loss_kwargs(out: Path) -> dict:
    config = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    model = T5ForConditionalGeneration(config)
    trainer = Trainer(model=model, args=arguments(out))
    return {"marked": getattr(model, "accepts_loss_kwargs", None), "trainer": trainer.model_accepts_loss_kwargs}


def files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def main() -> None:
    out, report = Path(sys.argv[1]), Path(sys.argv[2])
    result = {"first": train(out / "run", 4), "again": train(out / "run", 6)}
    result["files"] = files(out / "run")
    result["bf16"] = bf16_on_this_machine(out / "bf16")
    result["t5"] = t5_loss_kwargs(out / "t5")
    result["patched"] = hasattr(Trainer.train, "__wrapped__")  # hf_flexdemo's wrappers are in place
    report.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
