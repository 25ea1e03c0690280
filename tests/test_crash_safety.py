"""Crash-safe runs of `train_t5.py --preset offline` on 2 simulated nodes x 2 processes.

Real faults, as they happen: workers SIGKILLed at random moments of frequent saves under
`accelerate launch --max_restarts`, the launcher itself SIGKILLed, a disk that fills up, a
read-only output directory, a Hub that cannot be reached. Every run is compared with an
uninterrupted one, bitwise.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
from support.faults import alive, exited, kill_during_saves, saving_now, small_disk, workers
from support.launch import (
    REPO_ROOT,
    child_env,
    free_port,
    port_open,
    run_checked,
    start_logged,
    stopped_at_exit,
    wait_for,
)
from support.t5_run import FLAGS, STEPS, t5_command

from hf_flexdemo.integrations.checkpoints import checkpoints, incomplete_reason

pytestmark = pytest.mark.faults

RESTARTS = ["--max_restarts", "3", "--rdzv_backend", "c10d"]
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
LAYOUT_FREE = "cpu_1x2.yaml"
"""1 node x 2 processes, where the layout does not change what is checked (refusals before training, orphaned
workers): half the start-up cost of 2 x 2, and still a multi-process job."""


def losses(run_dir: Path) -> list[tuple[int, float]]:
    newest = checkpoints(run_dir)[-1][1]
    history = json.loads((newest / "trainer_state.json").read_text())["log_history"]
    return [(h["step"], h["loss"]) for h in history if "loss" in h]


@pytest.fixture(scope="module")
def uninterrupted(t5_reference) -> Path:
    return t5_reference.output_dir


def same_run_bitwise(run_dir: Path, uninterrupted: Path) -> None:
    """The same losses, the same final weights and the same tokenizer, bit for bit."""
    assert losses(run_dir) == losses(uninterrupted)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (run_dir / name).read_bytes() == (uninterrupted / name).read_bytes(), name


def test_every_checkpoint_is_marked_complete_and_loadable(uninterrupted):
    found = checkpoints(uninterrupted)
    assert [step for step, _ in found] == list(range(1, STEPS + 1))
    for _, folder in found:
        assert incomplete_reason(folder) is None
        # The tokenizer and config travel with every checkpoint (a sharded save has no weights file).
        assert (folder / "tokenizer.json").exists() and (folder / "config.json").exists()


def test_workers_killed_during_saves_restart_on_every_node_and_end_bitwise_equal(uninterrupted, tmp_path):
    """Two machines, one launcher each (c10d on loopback), as on a cluster; a worker of either is killed."""
    launchers, logs = [], []
    port = str(free_port())
    for machine in (0, 1):
        node = ("--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port", port)
        command = t5_command(tmp_path, launch=(*RESTARTS, *node), config="cpu_2machines.yaml")
        logs.append(tmp_path.parent / f"{tmp_path.name}-node{machine}.log")
        launchers.append(start_logged(command, logs[-1], env=child_env(**RESTART_ENV)))
        if machine == 0:  # machine 0 hosts the c10d rendezvous: let it bind the port before machine 1 asks
            wait_for(lambda: port_open(int(port)), 120, "machine 0's rendezvous port", poll=0.1)
    with stopped_at_exit(*launchers):
        killed = kill_during_saves(launchers, tmp_path, kills=2, seed=11)
        codes = [launcher.wait(timeout=600) for launcher in launchers]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    assert len(killed) == 2, killed
    for output in outputs:  # every node resumed, not only the one whose worker died
        assert "Automatic restart (restart " in output, output[-6000:]
    decisions = re.findall(r"Resuming from \S+, the newest complete|No complete checkpoint in", outputs[0])
    # Rank 0 chose once per new round: at least once per kill (a node whose workers lost their
    # peers may fail too and start one more round).
    assert len(decisions) >= 2, decisions
    # Fresh from the seed up to the first kill, then resumed twice: bit for bit the uninterrupted run.
    same_run_bitwise(tmp_path, uninterrupted)
    assert all(incomplete_reason(folder) is None for _, folder in checkpoints(tmp_path))


def test_a_job_whose_launcher_is_killed_stops_and_relaunched_with_the_same_command_resumes_keeping_its_checkpoints(
    tmp_path,
):
    """The launcher SIGKILLed during the save of checkpoint-8: its orphaned workers stop (they watch their parent)
    and say why. The same command again continues from the newest complete checkpoint, checkpoint-4 untouched.

    The run also loads its best model at the end (``--load_best_model_at_end`` on the sharded config), across the
    resume: the replicas must stay identical (FlexDeMoCallback compares them after the load and fails the run if
    they differ)."""
    best = "--load_best_model_at_end --eval_strategy steps --eval_steps 4 --metric_for_best_model loss"
    # 16 steps: the orphans notice the lost launcher within a second, far from finishing the job on their own.
    flags = ["--max_steps", "16", "--save_steps", "4", "--logging_steps", "4", *best.split()]
    command = t5_command(tmp_path, *flags, "--predict_with_generate", "false", "--log_level", "info")
    log = tmp_path.parent / f"{tmp_path.name}-first.log"
    # The workers inherit the log: their own word on why they stop stays readable.
    first, orphans = start_logged(command, log), []
    try:
        wait_for(lambda: saving_now(tmp_path, 4), 300, "the save of checkpoint-8", gone=exited(first))
        orphans = workers(first)
        assert len(orphans) == 4
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in orphans), 30, "the orphaned workers to stop")
    finally:
        for p in orphans:
            if alive(p):
                p.kill()
        first.kill()
    said = log.read_text()
    assert f"the launcher (pid {first.pid}) is gone; stopping this worker" in said, said[-4000:]
    kept = {path: path.stat().st_mtime_ns for path in (tmp_path / "checkpoint-4").rglob("*")}
    assert incomplete_reason(tmp_path / "checkpoint-4") is None, said[-4000:]
    newest = [folder for _, folder in checkpoints(tmp_path) if incomplete_reason(folder) is None][-1]
    proc = run_checked(command, timeout=600)
    output = proc.stdout + proc.stderr
    resumed = re.findall(r"Resuming from (\S+), the newest complete checkpoint of an earlier run", output)
    assert resumed == [str(newest)], output  # rank 0 says it once
    assert {path: path.stat().st_mtime_ns for path in (tmp_path / "checkpoint-4").rglob("*")} == kept
    assert [step for step, _ in checkpoints(tmp_path)] == [4, 8, 12, 16]
    assert all(incomplete_reason(folder) is None for _, folder in checkpoints(tmp_path))
    assert "Loading best model from" in output
    last = json.loads((tmp_path / "checkpoint-16" / "trainer_state.json").read_text())
    assert last["best_model_checkpoint"] == str(tmp_path / f"checkpoint-{last['best_global_step']}")


def test_a_full_disk_gives_one_clear_error_and_keeps_complete_checkpoints(uninterrupted):
    checkpoint_mb = sum(f.stat().st_size for f in (uninterrupted / "checkpoint-1").rglob("*") if f.is_file()) / 2**20
    with small_disk(int(checkpoint_mb * 2.6) + 1) as disk:
        if disk is None:
            pytest.skip("mounting a small tmpfs needs root and mount(8)")
        out = disk / "run"
        proc = subprocess.run(
            t5_command(out), env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert "the disk is full" in output and "Nothing complete was lost" in output, output[-6000:]
        assert "the newest complete checkpoint, " in output
        assert "inline_container" not in output and "[rank0]: Traceback" not in output, output[-6000:]
        found = checkpoints(out)
        assert [incomplete_reason(folder) for _, folder in found[:-1]] == [None] * (len(found) - 1)
        assert found and all(incomplete_reason(folder) is None for _, folder in found), found


def test_a_read_only_output_dir_is_refused_before_training():
    """In one process: the script's argument parsing refuses it (how a refusal reaches the user once from a launch
    is checked by tests/test_refusal_launches.py and the restart refusal above)."""
    from script_utils import parse_arguments
    from train_t5 import COMMON, PRESETS, T5Arguments
    from transformers import Seq2SeqTrainingArguments

    with small_disk(1, read_only=True) as disk:
        if disk is None:
            pytest.skip("mounting a read-only tmpfs needs root and mount(8)")
        argv = ["--output_dir", str(disk / "run"), *FLAGS]
        with pytest.raises(SystemExit) as refused:
            parse_arguments((T5Arguments, Seq2SeqTrainingArguments), PRESETS, COMMON, argv)
        said = str(refused.value)
        assert "cannot be written" in said and "Read-only file system" in said, said


def test_an_unreachable_hub_gives_one_clear_error(tmp_path):
    env = child_env(HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="hf_unused", HF_HUB_OFFLINE="0")
    command = t5_command(tmp_path, "--push_to_hub", "--hub_model_id", "test-user/t5", config=LAYOUT_FREE)
    proc = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "The Hub at http://127.0.0.1:9" in proc.stderr and "ConnectError" in proc.stderr, proc.stderr[-4000:]
    assert "nothing had been trained" in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr
