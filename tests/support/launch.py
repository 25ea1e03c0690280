"""Start multi-process jobs from tests and collect what each rank wrote."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: one thread each, tests importable, no network."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [str(TESTS_DIR), str(REPO_ROOT / "training_scripts"), str(REPO_ROOT), env.get("PYTHONPATH", "")]
        ),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
    )
    env.update(extra)
    return env


def failure_report(output: str) -> str:
    """The exception each worker process ended with (the root cause, which the launcher's own
    traceback at the end pushes out of the tail), then the output's tail."""
    raised = re.findall(r"^(\[rank\d+\]: \w+(?:Error|Exception|Interrupt)\b.*)$", output, flags=re.MULTILINE)
    return "".join(f"raised: {line}\n" for line in dict.fromkeys(raised)) + output[-6000:]


def run_checked(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run ``cmd``; on failure raise with the tail of its output so the test report shows why."""
    proc = subprocess.run(
        cmd, env=env or child_env(), cwd=cwd or REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        output = proc.stdout + "\n" + proc.stderr
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{failure_report(output)}")
    return proc


def start_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` with its output (and its children's) in the file ``log``.

    A file, not a pipe: a launcher blocked on a full pipe nobody reads would stall its peers.
    """
    with log.open("w") as out:
        return subprocess.Popen(cmd, env=env or child_env(), cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def stopped_at_exit(*launchers: subprocess.Popen):
    """On the way out of the block, whatever happened in it, none of ``launchers`` is left running."""
    try:
        yield
    finally:
        for launcher in launchers:
            launcher.kill()


def torchrun(script: Path, nprocs: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    return run_checked([*cmd, str(script), *args], timeout=timeout)


def read_rank_results(out_dir: Path, nprocs: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


PORTS_PER_WORKER = 1500
FIRST_PORT = 15_000
"""Below Linux's ephemeral range (32768 on), which the kernel hands out for port 0 (gloo, TCPStores)."""
_handed_out = random.randrange(PORTS_PER_WORKER)
"""Where this test process starts in its range: two pytest sessions on one machine rarely hand out the same port
(a port checked free is taken only later, by the launch it is for)."""


def free_port() -> int:
    """A loopback port nobody listens on now, and one this test process has not handed out before.

    A port is chosen before the launch that listens on it: two nodes of one test, chosen before
    either listens, could otherwise be given the same one (the kernel may hand a released port 0
    out again). Under pytest-xdist each worker takes ports from a range of its own.
    """
    global _handed_out
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = FIRST_PORT + int(worker or 0) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + _handed_out % PORTS_PER_WORKER
        _handed_out += 1
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {first}-{first + PORTS_PER_WORKER - 1}")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_for(condition, timeout: float, what: str, poll: float = 0.02, gone: Callable[[], str | None] | None = None):
    """Poll ``condition`` until it holds; returns its value.

    Fails at ``timeout``, or at once when ``gone()`` names why it never will (the process
    that was to bring it about has exited), rather than waiting out the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        reason = gone() if gone else None
        if reason:
            raise AssertionError(f"{reason} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
