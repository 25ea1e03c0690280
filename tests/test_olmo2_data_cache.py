"""train_olmo2.py in one process with simulated replicas, and ``--data_cache``: the second run skips preparing the
text and trains on the same tokens."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.scripts


def train(tmp_path, name: str, monkeypatch) -> list[dict]:
    import train_olmo2

    out = tmp_path / name
    argv = ["train_olmo2.py", "--preset", "offline", "--output_dir", str(out), "--data_cache", str(tmp_path / "cache")]
    argv += ["--hidden_size", "32", "--num_layers", "1", "--vocab_size", "512", "--block_size", "32"]
    argv += ["--max_train_samples", "120", "--max_eval_samples", "8", "--max_steps", "3", "--logging_steps", "1"]
    argv += ["--gradient_accumulation_steps", "2", "--optim_args", "topk=8,chunk=16,simulate_replicas=2"]
    monkeypatch.setattr(sys, "argv", argv)
    train_olmo2.main()
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def test_a_second_run_takes_the_cached_tokenizer_and_blocks_and_trains_the_same(tmp_path, monkeypatch):
    first = train(tmp_path, "first", monkeypatch)
    (cache,) = (tmp_path / "cache").iterdir()
    assert (cache / "ready").exists() and (cache / "tokenizer" / "tokenizer.json").exists()
    second = train(tmp_path, "second", monkeypatch)
    assert not (tmp_path / "second" / "offline_tokenizer").exists()  # no tokenizer trained this time
    losses = [[h["loss"] for h in log if "loss" in h] for log in (first, second)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert first[0]["flexdemo/bytes_sent"] > 0  # two replicas exchanged, in one process
