"""Shared test set-up: keep every test offline and single-threaded per process."""

import os
import sys
from pathlib import Path

import torch

# The scripts' helpers (offline data) are shared with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training_scripts"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)
