"""Launch tests/workers/trainer_worker.py with `accelerate launch` and read its results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .launch import TESTS_DIR, child_env, free_port, run_checked

COMMON = (
    "--max_steps 8 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --learning_rate 1e-3 "
    "--logging_steps 1 --save_steps 4 --report_to none --seed 7 --optim flexdemo --optim_args topk=8,chunk=16"
).split()
"""--optim flexdemo: the worker sets each run's own optim; FlexDeMo's keys under another optim are refused when parsed."""


def launch_command(*script_and_args: str, config: str = "cpu_2x2.yaml") -> list[str]:
    """``accelerate launch`` with a test config, as a user would run it.

    Each launch gets its own free rendezvous port (Accelerate's default, 29500, is shared with
    any other job on the machine and with a killed launch's last connections); a
    ``--main_process_port`` in ``script_and_args`` comes later and wins.
    """
    config_path = str(TESTS_DIR / "configs" / config)
    port = ("--main_process_port", str(free_port()))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_path, *port, *script_and_args]


TRAINER_WORKER = str(TESTS_DIR / "workers" / "trainer_worker.py")


def accelerate_launch(output_dir: Path, runs: str, *extra: str, timeout: float = 900):
    cmd = launch_command(TRAINER_WORKER, "--runs", runs, "--output_dir", str(output_dir), *COMMON, *extra)
    return run_checked(cmd, timeout=timeout, env=child_env())


def read_run(output_dir: Path, name: str, nprocs: int = 4) -> list[dict]:
    return [json.loads((output_dir / name / f"result_rank{r}.json").read_text()) for r in range(nprocs)]


def losses(result: dict) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in result["log_history"] if "loss" in h]
