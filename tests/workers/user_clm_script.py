"""A causal-LM Trainer script as a user writes it (after run_clm.py); it never imports hf_flexdemo.

A tiny Llama from a config, a byte-level BPE tokenizer trained on the spot, and Python's own
documentation as the corpus, grouped into blocks of ``block_size`` tokens:

    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml -m hf_flexdemo.run \\
        tests/workers/user_clm_script.py --optim flexdemo --output_dir out --max_steps 4
"""

from dataclasses import dataclass, field

from datasets import Dataset
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


@dataclass
class DataArguments:
    block_size: int = field(default=32, metadata={"help": "Tokens per training sample."})
    vocab_size: int = field(default=512, metadata={"help": "The tokenizer's vocabulary."})
    eval_blocks: int = field(default=32, metadata={"help": "Blocks held out for evaluation."})


def load_text() -> list[str]:
    return [topics[name] for name in sorted(topics)]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")


def group_blocks(texts: list[str], tok, block_size: int) -> Dataset:
    """run_clm.py's grouping: every text and an end-of-text token, concatenated and cut into blocks."""
    ids = [i for text in texts for i in tok(text)["input_ids"] + [tok.eos_token_id]]
    blocks = [ids[i : i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]
    return Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * block_size] * len(blocks),
                              "labels": blocks})  # fmt: skip


def splits(tok, data_args: DataArguments) -> tuple[Dataset, Dataset]:
    blocks = group_blocks(load_text(), tok, data_args.block_size)
    held_out = len(blocks) - data_args.eval_blocks
    return blocks.select(range(held_out)), blocks.select(range(held_out, len(blocks)))


def main():
    data_args, training_args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    tok = train_tokenizer(load_text(), data_args.vocab_size)
    train_data, eval_data = splits(tok, data_args)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=data_args.block_size, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    trainer = Trainer(
        model=LlamaForCausalLM(config),
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        processing_class=tok,
        data_collator=default_data_collator,
    )
    train_result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    if training_args.push_to_hub:
        trainer.push_to_hub(finetuned_from=None, tasks="text-generation")
    else:
        trainer.create_model_card(tasks="text-generation")


if __name__ == "__main__":
    main()
