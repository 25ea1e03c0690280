"""The stock training scripts (``training_scripts/``) as the quality studies run them: a user's command, the cache
of tokenized text, and what a finished run saved.

The short study (``quality_study.py``) and the long one (``long_run.py``) both launch their runs through here.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "accelerate_configs" / "cpu_2x2.yaml"
DATA_CACHE = ROOT / "benchmarks" / "results" / "quality" / "data_cache"
"""The presets at scale keep their tokenizer and tokenized text here (train_olmo2.py --data_cache; not in git)."""


def free_port() -> int:
    """A loopback port nobody listens on now: a study beside other jobs must not take their rendezvous port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: str, args: list[str], out: Path, one_process: bool = False) -> None:
    """A user's command: ``accelerate launch`` on 2 nodes x 2 processes, or (``one_process``) the script alone."""
    if one_process:  # every core to the one process, unless OMP_NUM_THREADS says otherwise (a shared machine)
        cmd, threads = [sys.executable], os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)
    else:
        cmd, threads = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG)], "1"
        cmd += ["--main_process_port", str(free_port())]
    cmd += [str(ROOT / "training_scripts" / script), "--preset", "offline", "--output_dir", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{out.name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def parameter_count(out: Path) -> int:
    """The saved model's parameters (tied weights once), read from its safetensors header."""
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
