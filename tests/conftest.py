"""Shared test set-up: keep every test offline and single-threaded per process."""

import os
import sys
from pathlib import Path

import pytest
import torch

# The scripts' helpers (offline data) are shared with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training_scripts"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def t5_reference(tmp_path_factory):
    """One uninterrupted T5 run on 2 x 2 (tests/support/t5_run.py), read by test_scripts and test_crash_safety."""
    from support.t5_run import reference_run

    return reference_run(tmp_path_factory.mktemp("t5_reference"))
