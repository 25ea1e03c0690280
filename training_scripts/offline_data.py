"""Offline presets: real data that installed packages ship, and tokenizers trained on the spot.

Nothing here touches the network, so the scripts' ``--preset offline`` runs anywhere:

- English text: the Python documentation topics in ``pydoc_data`` (standard library,
  about 65k words), and for longer runs the standard library's docstrings as well;
- English -> French (or German, ...) pairs: Django's translation catalogs (``.po`` files
  of its core and contrib apps, about 800 short UI sentences per language), read with polib;
- images: scikit-learn's 1,797 handwritten digits (8 x 8 grey levels, 10 classes);
- tokenizers: trained with ``tokenizers`` on that text in about a second, wrapped in
  ``PreTrainedTokenizerFast`` (BPE over T5-style Metaspace pieces with ``</s>``, or a
  byte-level BPE). Both trainers are deterministic (the Unigram trainer is not: two runs gave
  5% of token ids different meanings), so two runs with the same seed are the same run.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from datasets import Dataset, DatasetDict
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, TrainingArguments

from hf_flexdemo import elastic
from hf_flexdemo.integrations.checkpoints import newest_complete


def english_paragraphs() -> list[str]:
    """Paragraphs of English from Python's own documentation (``pydoc_data``)."""
    import pydoc_data.topics

    return [p for topic in pydoc_data.topics.topics.values() for p in _paragraphs(topic)]


def stdlib_docstrings() -> list[str]:
    """Paragraphs of the standard library's docstrings (tests and IDLE left out): about 4.6x
    :func:`english_paragraphs`, in a fixed order."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "test", "tests", "idlelib"}
    paragraphs = []
    for path in sorted(root.rglob("*.py")):
        if skipped.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are templates or in other encodings
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                paragraphs += _paragraphs(ast.get_docstring(node) or "")
    return paragraphs


def python_source(limit_mb: float = 40.0) -> list[str]:
    """The Python source of the standard library and of the installed packages, one document per file, in a fixed
    order, up to ``limit_mb`` MB: enough text that a model of about 100M parameters trains a thousand steps without
    repeating it. What it holds depends on the machine's packages: compare runs on one machine."""
    import sysconfig

    paths = sysconfig.get_paths()
    files = sorted({*Path(paths["stdlib"]).rglob("*.py"), *Path(paths["purelib"]).rglob("*.py")})
    documents, size = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 200:
            continue
        documents.append(text)
        size += len(text)
        if size >= limit_mb * 1e6:
            break
    return documents


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, whitespace folded; short ones and code examples left out."""
    blocks = (" ".join(block.split()) for block in re.split(r"\n\s*\n", text))
    return [b for b in blocks if len(b) > 40 and not b.startswith(("***", ">>>", "..."))]


def translation_pairs(source: str = "en", target: str = "fr") -> list[dict[str, str]]:
    """``{source: ..., target: ...}`` pairs from Django's message catalogs (source must be English)."""
    import django
    import polib

    if source != "en":
        raise ValueError(f"offline translation pairs: source={source!r}; Django's catalogs translate from 'en'.")
    root = os.path.dirname(django.__file__)
    files = sorted(glob.glob(f"{root}/conf/locale/{target}/LC_MESSAGES/*.po"))
    files += sorted(glob.glob(f"{root}/contrib/*/locale/{target}/LC_MESSAGES/*.po"))
    if not files:
        raise ValueError(f"offline translation pairs: Django has no catalogs for target={target!r}.")
    pairs: dict[str, str] = {}
    for path in files:
        for entry in polib.pofile(path):
            if entry.msgid and entry.msgstr and not entry.obsolete and "fuzzy" not in entry.flags:
                pairs.setdefault(entry.msgid, entry.msgstr)
    return [{source: s, target: t} for s, t in pairs.items()]


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits as ``uint8`` images (N, 8, 8) and labels (N,)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images * (255 / 16)).round().astype(np.uint8), digits.target.astype(np.int64)


def split(dataset: Dataset, eval_fraction: float, seed: int = 0) -> DatasetDict:
    """A seeded train/validation split."""
    parts = dataset.train_test_split(test_size=eval_fraction, seed=seed)
    return DatasetDict(train=parts["train"], validation=parts["test"])


def shared_tokenizer(train: Callable[[], PreTrainedTokenizerFast], args: TrainingArguments) -> PreTrainedTokenizerFast:
    """Train the tokenizer once, on the main process, and load that one in every process.

    Every process must use the same token ids; ``output_dir`` must be visible to all of them.
    A resumed run (``--resume_from_checkpoint``, an automatic restart, or a relaunch that finds
    an earlier run's complete checkpoints) reuses the tokenizer its first start saved in
    ``output_dir`` instead of training it again.
    """
    path = Path(args.output_dir) / "offline_tokenizer"
    resuming = bool(args.resume_from_checkpoint) or elastic.restart_count() > 0
    resuming = resuming or newest_complete(Path(args.output_dir)) is not None
    with args.main_process_first(local=False, desc="training the tokenizer"):
        if args.process_index == 0 and not (resuming and (path / "tokenizer.json").exists()):
            save_atomically(train(), path)
        elif not (path / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{path} is missing: the offline presets train the tokenizer on the main process, so "
                "--output_dir must be on a filesystem that every process sees."
            )
        return PreTrainedTokenizerFast.from_pretrained(path)


def save_atomically(tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """Save into ``path`` file by file with ``os.replace``: a reader never sees a half-written file.

    Fault-tolerant nodes are jobs of their own that share ``output_dir``: each node's main process
    trains the same tokenizer and saves it while the others may be reading it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        tokenizer.save_pretrained(scratch)
        path.mkdir(parents=True, exist_ok=True)
        for written in scratch.iterdir():
            os.replace(written, path / written.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def t5_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A T5-style tokenizer: BPE over Metaspace pieces, ``<pad>``=0, ``</s>``=1, ``<unk>``=2."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE for causal LMs: ``<pad>``=0, ``<|endoftext|>``=1 (end of document)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
