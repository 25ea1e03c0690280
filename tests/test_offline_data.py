"""The offline presets' data sources and the tokenizer every process must share."""

from __future__ import annotations

import pytest
from datasets import Dataset
from offline_data import digit_images, english_paragraphs, shared_tokenizer, split, stdlib_docstrings, translation_pairs
from transformers import TrainingArguments

pytestmark = pytest.mark.unit


def test_sources_are_real_and_present():
    assert sum(len(p.split()) for p in english_paragraphs()) > 50_000
    pairs = translation_pairs("en", "fr")
    assert len(pairs) > 700 and {"en": "Enter a valid value.", "fr": "Saisissez une valeur valide."} in pairs
    images, labels = digit_images()
    assert images.shape == (1797, 8, 8) and images.max() == 255 and set(labels.tolist()) == set(range(10))


def test_stdlib_docstrings_give_several_times_the_text_in_a_fixed_order():
    docstrings = stdlib_docstrings()
    assert sum(len(p.split()) for p in docstrings) > 3 * sum(len(p.split()) for p in english_paragraphs())
    assert docstrings[0] == "Record of phased-in incompatible language changes."  # __future__.py: files sorted


def test_an_unknown_offline_text_is_refused_naming_the_choices():
    from train_olmo2 import Olmo2Arguments, load_texts

    with pytest.raises(ValueError, match="--offline_text='wiki' is invalid; choose one of 'pydoc', 'stdlib', "):
        load_texts(Olmo2Arguments(preset="offline", offline_text="wiki"), seed=0)


def test_unknown_translation_pair_is_refused():
    with pytest.raises(ValueError, match="target='xx'"):
        translation_pairs("en", "xx")
    with pytest.raises(ValueError, match="source='de'"):
        translation_pairs("de", "fr")


def test_split_is_seeded():
    data = Dataset.from_dict({"x": list(range(100))})
    assert split(data, 0.1, seed=3)["validation"]["x"] == split(data, 0.1, seed=3)["validation"]["x"]


def test_shared_tokenizer_is_trained_once_and_loaded_by_the_others(tmp_path, monkeypatch):
    from offline_data import bpe_tokenizer

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    trained = shared_tokenizer(lambda: bpe_tokenizer(english_paragraphs()[:200], 300), args)
    assert (tmp_path / "offline_tokenizer" / "tokenizer.json").exists()
    # Another process (rank 1) loads the main process's file instead of training its own.
    monkeypatch.setattr(TrainingArguments, "process_index", property(lambda self: 1))
    loaded = shared_tokenizer(lambda: pytest.fail("rank 1 must not train"), args)
    assert loaded.get_vocab() == trained.get_vocab()
    missing = TrainingArguments(str(tmp_path / "elsewhere"), use_cpu=True, report_to="none")
    with pytest.raises(FileNotFoundError, match="filesystem that every process sees"):
        shared_tokenizer(lambda: pytest.fail("rank 1 must not train"), missing)


def test_a_resumed_run_reuses_the_saved_tokenizer_and_training_is_deterministic(tmp_path):
    from offline_data import t5_tokenizer

    texts = english_paragraphs()[:300]
    first = t5_tokenizer(texts, 400)
    assert t5_tokenizer(texts, 400).backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    shared_tokenizer(lambda: first, args)
    resumed = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", resume_from_checkpoint="auto")
    loaded = shared_tokenizer(lambda: pytest.fail("a resumed run must not train a new tokenizer"), resumed)
    assert loaded.get_vocab() == first.get_vocab()


def test_nodes_saving_the_tokenizer_into_one_folder_never_leave_a_half_written_file(tmp_path):
    """Fault-tolerant nodes share output_dir: each node's main process saves while the others read."""
    import json
    import threading

    from offline_data import bpe_tokenizer, save_atomically

    tokenizer = bpe_tokenizer(english_paragraphs()[:200], 300)
    path = tmp_path / "offline_tokenizer"
    save_atomically(tokenizer, path)
    bad, done = [], threading.Event()

    def read_until_done():
        while not done.is_set():
            for name in ("tokenizer.json", "tokenizer_config.json"):
                try:
                    json.loads((path / name).read_text())
                except json.JSONDecodeError as e:
                    bad.append(f"{name}: {e}")

    reader = threading.Thread(target=read_until_done)
    reader.start()
    for _ in range(20):
        save_atomically(tokenizer, path)
    done.set()
    reader.join()
    assert not bad, bad[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offline_tokenizer"]  # no scratch folder left
