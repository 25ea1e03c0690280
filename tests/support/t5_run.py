"""`train_t5.py --preset offline` on 2 x 2, as the scripts and crash-safety tests launch it.

One uninterrupted run serves both files (the `t5_reference` fixture in conftest.py): test_scripts reads its push,
wandb record and card, and test_crash_safety compares every interrupted run with it bit for bit. Pushing and
logging to wandb do not change what trains, so the interrupted runs leave both out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess

from .accelerate_runs import launch_command
from .fake_hub import CommitRecord, FakeHub
from .launch import REPO_ROOT, child_env, run_checked

SCRIPT = str(REPO_ROOT / "training_scripts" / "train_t5.py")
STEPS = 10
FLAGS = (
    f"--preset offline --max_steps {STEPS} --save_strategy steps --save_steps 1 --logging_steps 1 "
    "--max_eval_samples 16 --generation_max_length 16 --seed 3"
).split()
TOKEN = "hf_flexdemo_test_secret_token"
REPO_ID = "test-user/t5-flexdemo"


def t5_command(output_dir: Path, *flags: str, launch: tuple[str, ...] = (), config: str = "cpu_2x2.yaml") -> list[str]:
    return launch_command(*launch, SCRIPT, "--output_dir", str(output_dir), *FLAGS, *flags, config=config)


def push_flags(repo_id: str) -> list[str]:
    return ["--push_to_hub", "--hub_token", TOKEN, "--hub_strategy", "every_save", "--hub_model_id", repo_id]


@dataclass
class ReferenceRun:
    """The uninterrupted run: its folder, what it printed, and what reached the Hub and wandb."""

    output_dir: Path
    wandb_dir: Path
    process: CompletedProcess
    hub_files: dict[str, bytes]
    hub_commits: list[CommitRecord]


def reference_run(root: Path) -> ReferenceRun:
    """Push every save to a local stand-in of the Hub (the token passed as a flag only) and log to wandb offline."""
    with FakeHub(token=TOKEN) as hub:
        env = hub.env(child_env(WANDB_DIR=str(root / "wandb"), HF_HOME=str(root / "hf_home")), with_token=False)
        command = t5_command(root / "t5", "--report_to", "wandb", *push_flags(REPO_ID))
        process = run_checked(command, timeout=900, env=env)
        return ReferenceRun(root / "t5", root / "wandb", process, hub.files(REPO_ID), hub.commits(REPO_ID))
