"""Pretrain OLMo2 from its config (or continue training a checkpoint) with FlexDeMo.

    # Offline, on one CPU machine as 2 simulated nodes x 2 processes:
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_olmo2.py --preset offline
    # The AdamW-HSDP baseline on the same data and model:
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_olmo2.py \
        --preset offline --optim adamw_torch --output_dir outputs/olmo2-offline-adamw

    # OLMo-2 1B from its config on WikiText-103, 2 GPU nodes x 8; run on every node:
    accelerate launch --config_file accelerate_configs/flexdemo.yaml \
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR \
        training_scripts/train_olmo2.py --bf16
    # Continued training of the released checkpoint instead:  add --no_from_config

    # Fine-tuning offline: a model saved by an offline run (Hub format), trained on other text:
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_olmo2.py \
        --preset offline --offline_text docstrings --optim adamw_torch --output_dir outputs/olmo2-base
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_olmo2.py \
        --preset offline --model_name_or_path outputs/olmo2-base --no_from_config --offline_text pydoc

Every `TrainingArguments` flag works; `--optim flexdemo` is the default. The offline preset
trains a tiny OLMo2 built from a config, with a byte-level BPE trained on the spot, on the
English text of Python's documentation; with ``--no_from_config`` it loads the model and
tokenizer from ``--model_name_or_path`` (a folder or a Hub id) instead. Perplexity is
exp(validation loss).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from itertools import chain
from pathlib import Path

from datasets import Dataset, load_dataset, load_from_disk
from offline_data import (
    bpe_tokenizer,
    english_paragraphs,
    python_source,
    shared_tokenizer,
    split,
    stdlib_docstrings,
)
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
    AutoModelForCausalLM,
    AutoTokenizer,
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
)


@dataclasses.dataclass
class Olmo2Arguments(ScriptArguments):
    model_name_or_path: str = "allenai/OLMo-2-0425-1B"
    from_config: bool = True  # pretraining; --no_from_config continues the checkpoint
    dataset_name: str = "Salesforce/wikitext"
    dataset_config_name: str | None = "wikitext-103-raw-v1"
    text_column: str = "text"
    block_size: int = dataclasses.field(default=1024, metadata={"help": "Tokens per training sequence."})
    eval_fraction: float = 0.01
    vocab_size: int = dataclasses.field(default=4096, metadata={"help": "offline: tokenizer vocabulary."})
    hidden_size: int = dataclasses.field(default=128, metadata={"help": "offline: model width."})
    num_layers: int = dataclasses.field(default=2, metadata={"help": "offline: decoder layers."})
    data_cache: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "offline, from a config: a folder that keeps the trained tokenizer and the tokenized blocks, so "
            "that later runs with the same text, vocabulary, block size, seed and sample limits skip preparing them "
            "(a minute for 'python_source'). The key does not cover the preparation's code or the installed packages "
            "that 'python_source' reads: empty the folder after changing either."
        },
    )
    offline_text: str = dataclasses.field(
        default="pydoc",
        metadata={
            "help": "offline: 'pydoc' (Python's documentation topics, 1,900 paragraphs), 'stdlib' (those and "
            "the standard library's docstrings, 4.6x the text: for runs of more than a few epochs' worth of steps) "
            "'docstrings' (the docstrings alone: a base model to fine-tune on 'pydoc'), or 'python_source' (the "
            "Python source of the standard library and the installed packages, 40 MB: for models of 100M "
            "parameters and more)."
        },
    )


COMMON = dict(eval_strategy="no")
PRESETS = {
    "hub": dict(
        output_dir="outputs/olmo2-wikitext", learning_rate=3e-4, max_steps=10_000, per_device_train_batch_size=8
    ),
    "offline": dict(
        output_dir="outputs/olmo2-offline",
        block_size=128,
        learning_rate=4e-3,  # the best of FlexDeMo's default rule and of AdamW-HSDP in the quality study
        num_train_epochs=3,
        per_device_train_batch_size=8,
    ),
}


def load_texts(args: Olmo2Arguments, seed: int):
    """(train, validation) datasets with one "text" column."""
    if args.offline:
        texts = {
            "pydoc": english_paragraphs,
            "stdlib": lambda: english_paragraphs() + stdlib_docstrings(),
            "docstrings": stdlib_docstrings,
            "python_source": python_source,
        }
        if args.offline_text not in texts:
            choices = ", ".join(repr(name) for name in texts)
            raise ValueError(f"--offline_text={args.offline_text!r} is invalid; choose one of {choices}.")
        return split(Dataset.from_dict({"text": texts[args.offline_text]()}), 0.1, seed)
    raw = load_dataset(args.dataset_name, args.dataset_config_name)
    if "validation" not in raw:
        raw = split(raw["train"], args.eval_fraction, seed)
    return raw.rename_column(args.text_column, "text") if args.text_column != "text" else raw


def build_model_and_tokenizer(args: Olmo2Arguments, train: Dataset, training_args: TrainingArguments):
    if args.offline and args.from_config:
        tokenizer = shared_tokenizer(lambda: bpe_tokenizer(list(train["text"]), args.vocab_size), training_args)
        return offline_model(args, tokenizer), tokenizer
    return hub_model(AutoModelForCausalLM, args), AutoTokenizer.from_pretrained(args.model_name_or_path)


def offline_model(args: Olmo2Arguments, tokenizer) -> Olmo2ForCausalLM:
    """The offline preset's OLMo2, built from a config around ``tokenizer``."""
    config = Olmo2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=4,
        max_position_embeddings=args.block_size,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Olmo2ForCausalLM(config)


class LanguageModelTrainer(ScriptTrainerMixin, Trainer):
    pass


def main() -> None:
    args, training_args = parse_arguments((Olmo2Arguments, TrainingArguments), PRESETS, COMMON)
    cache = data_cache(args, training_args)
    if cache is not None and (cache / "ready").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(cache / "tokenizer")
        blocks = load_from_disk(str(cache / "blocks"))
        model = offline_model(args, tokenizer)
    else:
        model, tokenizer, blocks = prepare(args, training_args)
        if cache is not None and training_args.process_index == 0:
            tokenizer.save_pretrained(cache / "tokenizer")
            blocks.save_to_disk(str(cache / "blocks"))
            (cache / "ready").touch()  # last: a cache cut short is prepared again
    train_blocks(args, training_args, model, tokenizer, blocks)


def data_cache(args: Olmo2Arguments, training_args: TrainingArguments) -> Path | None:
    """``--data_cache``'s folder for this run's text, tokenizer and blocks; None without it (or off the offline
    preset's model built from a config)."""
    if not (args.data_cache and args.offline and args.from_config):
        return None
    key = [args.offline_text, args.vocab_size, args.block_size, training_args.seed]
    key += [args.max_train_samples, args.max_eval_samples]
    return Path(args.data_cache) / hashlib.sha1(json.dumps(key).encode()).hexdigest()[:12]


def prepare(args: Olmo2Arguments, training_args: TrainingArguments):
    """The model, its tokenizer, and the text cut into blocks of ``block_size`` tokens."""
    with training_args.main_process_first(desc="loading data"):
        data = load_texts(args, training_args.seed)
    limit_samples(data, args)
    model, tokenizer = build_model_and_tokenizer(args, data["train"], training_args)

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"] if t.strip()])

    def group(batch):
        """Concatenate documents and cut them into blocks of block_size tokens."""
        joined = {k: list(chain(*batch[k])) for k in batch}
        usable = len(joined["input_ids"]) // args.block_size * args.block_size
        blocks = {k: [v[i : i + args.block_size] for i in range(0, usable, args.block_size)] for k, v in joined.items()}
        blocks["labels"] = [list(b) for b in blocks["input_ids"]]
        return blocks

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = data.map(tokenize, batched=True, remove_columns=["text"], desc="Tokenizing")
        blocks = tokenized.map(group, batched=True, desc=f"Grouping into blocks of {args.block_size}")
    return model, tokenizer, blocks


def train_blocks(args: Olmo2Arguments, training_args: TrainingArguments, model, tokenizer, blocks) -> None:
    with hub_errors(training_args):
        trainer = LanguageModelTrainer(
            model=model,
            args=training_args,
            train_dataset=blocks["train"],
            eval_dataset=blocks["validation"],
            processing_class=tokenizer,
            data_collator=default_data_collator,
        )
    offline_texts = {
        "pydoc": "the English text of Python's documentation (pydoc_data)",
        "stdlib": "the English text of Python's documentation and the standard library's docstrings",
        "docstrings": "the standard library's docstrings",
        "python_source": "the Python source of the standard library and installed packages",
    }
    dataset = offline_texts.get(args.offline_text) if args.offline else args.dataset_name
    trainer.card_info = card_info(
        args,
        "an OLMo2 causal language model" + (" pretrained from its config" if args.from_config else ""),
        f"{dataset} ({len(blocks['train'])} training blocks of {args.block_size} tokens).",
        ["text-generation", "olmo2"],
    )
    train_and_report(
        trainer,
        ["eval_loss", "eval_perplexity"],
        derived=lambda m: {"eval_perplexity": math.exp(min(m["eval_loss"], 50.0))},
    )


if __name__ == "__main__":
    main()
    exit_worker()  # after a distributed job: no teardown for gloo's threads to abort in
