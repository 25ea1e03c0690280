"""Tiny Hugging Face models built from configs, on the scripts' offline text and tokenizer."""

from __future__ import annotations

import hashlib
import json

from datasets import Dataset
from offline_data import bpe_tokenizer, english_paragraphs
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
    text = " ".join(english_paragraphs())
    out = [s.strip() + "." for s in text.split(". ") if 20 < len(s.strip()) < 200]
    return out[:limit]


def tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE: <pad> = 0, end of text = 1 (T5's pad and eos ids)."""
    return bpe_tokenizer(sentences(), vocab_size)


CAUSAL_LMS = {"olmo2": (Olmo2Config, Olmo2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def tiny_model(kind: str, vocab_size: int):
    special = {"pad_token_id": 0, "eos_token_id": 1}
    if kind == "t5":
        config = T5Config(
            vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            decoder_start_token_id=0, **special,
        )  # fmt: skip
        return T5ForConditionalGeneration(config)
    config_class, model_class = CAUSAL_LMS[kind]
    config = config_class(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, bos_token_id=1, **special,
    )  # fmt: skip
    return model_class(config)


def dataset(kind: str, tok, rows: int = 256, length: int = 32) -> Dataset:
    texts = sentences(rows)
    if kind == "t5":  # copy the sentence: a seq2seq task a tiny model learns quickly
        enc = tok(texts, max_length=length, truncation=True, padding="max_length")
        labels = [[t if t != tok.pad_token_id else -100 for t in ids] for ids in enc["input_ids"]]
        return Dataset.from_dict({**enc, "labels": labels})
    enc = tok(texts, max_length=length, truncation=True, padding="max_length")
    labels = [
        [t if m else -100 for t, m in zip(ids, mask)] for ids, mask in zip(enc["input_ids"], enc["attention_mask"])
    ]
    return Dataset.from_dict({**enc, "labels": labels})


def sample_hash(input_ids) -> str:
    """A short name for one sample, the same in every process: which node read what."""
    return hashlib.sha1(json.dumps(list(input_ids)).encode()).hexdigest()[:16]
