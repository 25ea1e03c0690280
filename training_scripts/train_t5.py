"""Fine-tune (or pretrain from its config) a T5 translation model with FlexDeMo.

    # Offline, on one CPU machine as 2 simulated nodes x 2 processes (the README's main job):
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_t5.py --preset offline
    # The AdamW-HSDP baseline on the same data and model:
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_t5.py \
        --preset offline --optim adamw_torch --output_dir outputs/t5-offline-adamw

    # t5-small on OPUS books en->fr (the paper's set-up), 2 GPU nodes x 8; run on every node:
    accelerate launch --config_file accelerate_configs/flexdemo.yaml \
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR \
        training_scripts/train_t5.py --bf16 \
        --push_to_hub --hub_model_id you/t5-small-opus-en-fr-flexdemo
    # Pretraining from the config (random weights) instead of fine-tuning:  add --from_config

Every `TrainingArguments`/`Seq2SeqTrainingArguments` flag works; `--optim flexdemo` is the
default. The offline preset trains a tiny T5 built from a config, with a tokenizer trained
on the spot, on Django's English->French message catalogs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import evaluate
import numpy as np
from datasets import Dataset, load_dataset
from offline_data import english_paragraphs, shared_tokenizer, split, t5_tokenizer, translation_pairs
from script_utils import (
    ScriptArguments,
    ScriptTrainerMixin,
    card_info,
    exit_worker,
    hub_errors,
    hub_model,
    limit_samples,
    parse_arguments,
    train_and_report,
)
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

METRIC = str(Path(__file__).resolve().parent / "metrics" / "translation_scores.py")
LANGUAGES = {"en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt": "Portuguese"}


@dataclasses.dataclass
class T5Arguments(ScriptArguments):
    model_name_or_path: str = "google-t5/t5-small"
    dataset_name: str = "Helsinki-NLP/opus_books"
    dataset_config_name: str | None = "en-fr"
    source_lang: str = "en"
    target_lang: str = "fr"
    max_source_length: int = 128
    max_target_length: int = 128
    vocab_size: int = dataclasses.field(default=2000, metadata={"help": "offline: tokenizer vocabulary."})
    model_size: str = dataclasses.field(
        default="tiny",
        metadata={"help": "offline: 'tiny' (about 1M parameters) or 't5-small' (its architecture, 60M parameters)."},
    )


COMMON = dict(predict_with_generate=True, generation_max_length=64, eval_strategy="no")
PRESETS = {
    "hub": dict(
        output_dir="outputs/t5-opus-books", learning_rate=1e-4, num_train_epochs=10, per_device_train_batch_size=32
    ),
    "offline": dict(
        output_dir="outputs/t5-offline",
        # Near the best of both optimizers in the quality study (BENCHMARKS.md): FlexDeMo's default rule
        # and AdamW-HSDP (within 0.4% of its best, 4e-3).
        learning_rate=8e-3,
        num_train_epochs=30,
        per_device_train_batch_size=16,
        warmup_steps=20,
        logging_steps=20,
    ),
}


def load_pairs(args: T5Arguments, seed: int):
    """(train, validation) datasets of {"source", "target"} strings."""
    if args.offline:
        pairs = translation_pairs(args.source_lang, args.target_lang)
        data = Dataset.from_list([{"source": p[args.source_lang], "target": p[args.target_lang]} for p in pairs])
        return split(data, args.eval_fraction * 2, seed)  # a tiny set: hold out 10%
    raw = load_dataset(args.dataset_name, args.dataset_config_name)
    if "validation" not in raw:
        raw = split(raw["train"], args.eval_fraction, seed)

    def flatten(batch):
        return {
            "source": [t[args.source_lang] for t in batch["translation"]],
            "target": [t[args.target_lang] for t in batch["translation"]],
        }

    return raw.map(flatten, batched=True, remove_columns=raw["train"].column_names, desc="Extracting pairs")


def build_model_and_tokenizer(args: T5Arguments, train: Dataset, training_args: Seq2SeqTrainingArguments):
    if args.offline:
        texts = list(train["source"]) + list(train["target"]) + english_paragraphs()
        tokenizer = shared_tokenizer(lambda: t5_tokenizer(texts, args.vocab_size), training_args)
        special = dict(
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
        if args.model_size == "t5-small":  # T5Config's defaults are t5-small; keep its 32128-row embedding
            config = T5Config(**special)
        elif args.model_size == "tiny":
            config = T5Config(
                vocab_size=len(tokenizer), d_model=128, d_kv=32, d_ff=512, num_layers=2, num_heads=4, **special
            )
        else:
            raise ValueError(f"--model_size={args.model_size!r} is invalid; choose 'tiny' or 't5-small'.")
        return T5ForConditionalGeneration(config), tokenizer
    return hub_model(AutoModelForSeq2SeqLM, args), AutoTokenizer.from_pretrained(args.model_name_or_path)


class TranslationTrainer(ScriptTrainerMixin, Seq2SeqTrainer):
    pass


def build(argv: list[str] | None = None) -> TranslationTrainer:
    """Parse the arguments and build the Trainer, data and metric included (the benchmarks reuse it)."""
    args, training_args = parse_arguments((T5Arguments, Seq2SeqTrainingArguments), PRESETS, COMMON, argv)
    with training_args.main_process_first(desc="loading data"):
        data = load_pairs(args, training_args.seed)
    limit_samples(data, args)
    model, tokenizer = build_model_and_tokenizer(args, data["train"], training_args)
    source, target = (LANGUAGES.get(code, code) for code in (args.source_lang, args.target_lang))
    prefix = f"translate {source} to {target}: "

    def tokenize(batch):
        encoded = tokenizer([prefix + s for s in batch["source"]], max_length=args.max_source_length, truncation=True)
        targets = tokenizer(text_target=batch["target"], max_length=args.max_target_length, truncation=True)
        encoded["labels"] = targets["input_ids"]
        return encoded

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = data.map(tokenize, batched=True, remove_columns=["source", "target"], desc="Tokenizing")
    metric = evaluate.load(METRIC)

    def compute_metrics(prediction):
        predicted = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        labels = np.where(prediction.label_ids < 0, tokenizer.pad_token_id, prediction.label_ids)
        decoded = [s.strip() for s in tokenizer.batch_decode(predicted, skip_special_tokens=True)]
        references = [[s.strip()] for s in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        return metric.compute(predictions=decoded, references=references)

    with hub_errors(training_args):
        trainer = TranslationTrainer(
            model=model,
            args=training_args,
            train_dataset=tokenized["train"],
            eval_dataset=tokenized["validation"],
            processing_class=tokenizer,
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
            # BLEU/chrF need generated text; without --predict_with_generate only the loss is evaluated.
            compute_metrics=compute_metrics if training_args.predict_with_generate else None,
        )
    dataset = f"Django's {args.source_lang}->{args.target_lang} message catalogs" if args.offline else args.dataset_name
    trainer.card_info = card_info(
        args,
        f"a T5 model translating {source} to {target}",
        f"{dataset} ({len(data['train'])} training pairs, {len(data['validation'])} held out).",
        ["translation", "t5"],
    )
    return trainer


def main() -> None:
    train_and_report(build(), ["eval_loss", "eval_bleu", "eval_chrf"])


if __name__ == "__main__":
    main()
    exit_worker()  # after a distributed job: no teardown for gloo's threads to abort in
