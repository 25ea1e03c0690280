"""Fault injection for multi-process runs: SIGKILL workers mid-save, kill the launcher, small disks."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from hf_flexdemo.integrations.checkpoints import MARKER, checkpoints

from .launch import wait_for


def workers(*launchers: subprocess.Popen) -> list[psutil.Process]:
    """The worker processes of ``accelerate launch`` processes (their direct children)."""
    found = []
    for launcher in launchers:
        try:
            found += psutil.Process(launcher.pid).children()
        except psutil.NoSuchProcess:
            pass
    return found


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie; one that exits while it is being looked at is not alive."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exited(*launchers: subprocess.Popen):
    """For ``wait_for(gone=...)``: which of ``launchers`` has exited, and how."""

    def gone() -> str | None:
        ended = next((launcher for launcher in launchers if launcher.poll() is not None), None)
        return None if ended is None else f"the launcher (pid {ended.pid}) exited with {ended.returncode}"

    return gone


def saving_now(run_dir: Path, after_step: int) -> int | None:
    """The step of a checkpoint newer than ``after_step`` that is being written (no marker yet)."""
    for step, folder in checkpoints(run_dir):
        if step > after_step and not (folder / MARKER).exists():
            return step
    return None


def kill_during_saves(launchers: list[subprocess.Popen], run_dir: Path, kills: int, seed: int) -> list[str]:
    """SIGKILL a random worker at a random moment of ``kills`` different saves; returns what was killed.

    Waits for a checkpoint directory without its completion marker, sleeps 0-150 ms (seeded),
    then kills one worker of any launcher, chosen at random; before the next kill the
    restarted workers must have written a newer checkpoint.
    """
    rng = random.Random(seed)
    done, last_step = [], 0
    running = lambda: all(launcher.poll() is None for launcher in launchers)  # noqa: E731
    for _ in range(kills):
        step = wait_for(lambda: saving_now(run_dir, last_step), 300, "a save to start", gone=exited(*launchers))
        time.sleep(rng.uniform(0.0, 0.15))
        candidates = workers(*launchers)
        if not candidates:
            break
        victim = rng.choice(candidates)
        victim.send_signal(signal.SIGKILL)
        done.append(f"pid {victim.pid} during the save of checkpoint-{step}")
        last_step = step
        # Every agent restarts its workers; wait until the victim is gone before looking again.
        wait_for(lambda: not running() or victim.pid not in [w.pid for w in workers(*launchers)], 60, "restart")
    return done


@contextlib.contextmanager
def small_disk(megabytes: int, read_only: bool = False):
    """A tmpfs of ``megabytes`` (root and mount(8) needed); yields its path or None when it cannot be made."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix="flexdemo-disk-"))
    options = f"size={megabytes}m" + (",ro" if read_only else "")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if made.returncode != 0:
        path.rmdir()
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)
