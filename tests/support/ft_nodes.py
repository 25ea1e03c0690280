"""A real torchft Lighthouse and fault-tolerant nodes, each its own `accelerate launch`, for tests.

Every node runs in its own session, so that one SIGKILL of its process group takes down
the launcher and every worker of the node at once, as when a machine is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from .accelerate_runs import launch_command
from .launch import TESTS_DIR, child_env, failure_report, free_port, port_open, wait_for

WORKER = str(TESTS_DIR / "workers" / "ft_worker.py")


class Lighthouse:
    """``torchft_lighthouse`` started as its users start it, on a free loopback port."""

    def __init__(self, log: Path, min_replicas: int = 1, heartbeat_timeout_ms: int = 2000, join_timeout_ms: int = 2000):
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.heartbeat_timeout_s = heartbeat_timeout_ms / 1000  # how long a lost node still counts as live
        binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                "--min_replicas", str(min_replicas),
                "--bind", f"127.0.0.1:{self.port}",
                "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
                "--join_timeout_ms", str(join_timeout_ms),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        # Its entry point imports torchft (and torch) first: seconds when idle, a minute under heavy load.
        # A Lighthouse that exits fails the wait at once, so the deadline only bounds a hang.
        wait_for(lambda: port_open(self.port), 180, "the Lighthouse to listen", poll=0.2, gone=self._exited)

    def _exited(self) -> str | None:
        return None if self.proc.poll() is None else f"torchft_lighthouse exited with {self.proc.returncode}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def wait_until(condition, timeout: float, what: str, every: float = 0.2, running: Sequence[Node] = ()) -> None:
    """``wait_for`` that fails at once, with the node's log, when a node of ``running`` has exited."""

    def gone() -> str | None:
        ended = next((node for node in running if node.proc.poll() is not None), None)
        if ended is None:
            return None
        return f"node{ended.index} exited with {ended.proc.returncode}:\n{failure_report(ended.log())}\n"

    wait_for(condition, timeout, what, poll=every, gone=gone)


def kill_node(launcher_pid: int) -> None:
    """SIGKILL a launcher and all its descendants at once (torchrun starts workers in sessions of their own)."""
    launcher = psutil.Process(launcher_pid)
    for process in [launcher, *launcher.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)


class Node:
    """One node: `accelerate launch` of the worker with this node's REPLICA_GROUP_ID."""

    def __init__(self, index: int, nodes: int, lighthouse: str, output_dir: Path, *flags: str, config: str, launch=()):
        self.index, self.output_dir = index, output_dir
        self.dir = output_dir / f"node{index}"
        self.command = launch_command(
            "--main_process_port",
            str(free_port()),
            *launch,
            WORKER,
            "--output_dir",
            str(output_dir),
            *flags,
            config=config,
        )
        self.env = child_env(TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(index), NUM_REPLICA_GROUPS=str(nodes))
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.log_path = self.output_dir / f"node{self.index}_launch{self.starts}.log"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> float:
        """SIGKILL the launcher and every worker of the node; returns when it happened."""
        when = time.time()
        kill_node(self.proc.pid)
        self.proc.wait()
        return when

    def pause(self) -> None:
        """SIGSTOP the launcher and every worker: the node stops dead (no heartbeat), as a frozen machine does."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        launcher = psutil.Process(self.proc.pid)
        for process in [launcher, *launcher.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_node(self.proc.pid)
            why = failure_report(self.log())
            raise AssertionError(f"node{self.index} did not finish in {timeout:.0f} s:\n{why}") from None

    def log(self) -> str:
        """Everything the node's launch printed (the latest launch)."""
        return self.log_path.read_text()

    def progress(self, rank: int = 0) -> list[dict]:
        path = self.dir / f"progress_rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def step(self) -> int:
        lines = self.progress()
        return lines[-1]["step"] if lines else 0

    def result(self, rank: int) -> dict:
        return json.loads((self.dir / f"result_rank{rank}.json").read_text())
