"""Tiny Hugging Face models built from configs, a tokenizer trained on the spot, offline text."""

from __future__ import annotations

import pydoc_data.topics
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)


def sentences(limit: int = 4000) -> list[str]:
    """Short English sentences from the Python documentation that ships with Python."""
    text = " ".join(pydoc_data.topics.topics.values())
    out = [s.strip() + "." for s in text.replace("\n", " ").split(". ") if 20 < len(s.strip()) < 200]
    return out[:limit]


def tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"])
    tok.train_from_iterator(sentences(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_model(kind: str, vocab_size: int):
    if kind == "t5":
        config = T5Config(
            vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
        return T5ForConditionalGeneration(config)
    if kind == "olmo2":
        config = Olmo2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        )
        return Olmo2ForCausalLM(config)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        )
        return LlamaForCausalLM(config)
    raise ValueError(kind)


def dataset(kind: str, tok, rows: int = 256, length: int = 32) -> Dataset:
    texts = sentences(rows)
    if kind == "t5":  # copy the sentence: a seq2seq task a tiny model learns quickly
        enc = tok(texts, max_length=length, truncation=True, padding="max_length")
        labels = [[t if t != tok.pad_token_id else -100 for t in ids] for ids in enc["input_ids"]]
        return Dataset.from_dict({**enc, "labels": labels})
    enc = tok(texts, max_length=length, truncation=True, padding="max_length")
    labels = [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    return Dataset.from_dict({**enc, "labels": labels})
