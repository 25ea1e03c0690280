"""What the benchmarks share: the repository's paths, shapes, and launching torchft nodes and their Lighthouse.

A benchmark in a folder of ``benchmarks/`` imports it after putting ``benchmarks/`` on ``sys.path``
(``sys.path.insert(0, str(Path(__file__).resolve().parents[1]))``), as its scripts are run by path.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
"""The repository."""
SCRIPT = ROOT / "training_scripts" / "train_t5.py"
FT_CONFIG = ROOT / "accelerate_configs" / "cpu_ft_node.yaml"
PLAIN_CONFIG = ROOT / "accelerate_configs" / "cpu_2x2.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launch:
    """One `accelerate launch` whose logged steps are timestamped as they arrive."""

    def __init__(
        self,
        config: Path,
        output_dir: Path,
        steps: int,
        env: dict[str, str],
        optim_args: str,
        extra=(),
        script: Path = SCRIPT,
        processes: int | None = None,
        cores: set[int] | None = None,
    ):
        args = [
            "--preset", "offline", "--max_steps", str(steps), "--logging_steps", "1", "--save_strategy", "no",
            "--eval_strategy", "no", "--max_eval_samples", "8", "--report_to", "none",
            "--output_dir", str(output_dir), "--optim_args", optim_args, "--learning_rate", "2e-3", *extra,
        ]  # fmt: skip
        if script == SCRIPT:
            args += ["--generation_max_length", "8"]
        launcher = ["--num_processes", str(processes)] if processes else []
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), *launcher,
            "--main_process_port", str(free_port()), str(script), *args,
        ]  # fmt: skip
        base = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
        self.started = time.time()
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None  # the launcher and its workers
        self.proc = subprocess.Popen(
            cmd, env={**base, **env}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=pin,
        )  # fmt: skip
        self.steps: list[tuple[float, dict]] = []
        self.tail: list[str] = []
        self.said: list[str] = []  # every "FlexDeMo fault tolerance:" line, in full
        self.eval_loss: float | None = None
        node = env.get("REPLICA_GROUP_ID", "0")
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.log = (Path(output_dir) / f"launch_node{node}.log").open("a", buffering=1)  # all of it, for a post-mortem
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.time()
            self.tail = (self.tail + [line])[-40:]
            self.log.write(line)
            final = re.search(r"eval_loss\s*=\s*([\d.]+)", line)  # the script's closing evaluation
            if final:
                self.eval_loss = float(final[1])
            if "FlexDeMo fault tolerance:" in line:
                self.said.append(line[line.index("FlexDeMo fault tolerance:") :].strip())
            start = line.find("{'loss'")
            if start >= 0:
                try:
                    self.steps.append((now, ast.literal_eval(line[start : line.rindex("}") + 1])))
                except (ValueError, SyntaxError):
                    pass

    def kill(self) -> float:
        """SIGKILL the launcher and all its workers at once (a lost machine)."""
        when = time.time()
        launcher = psutil.Process(self.proc.pid)
        for process in [launcher, *launcher.children(recursive=True)]:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        return when

    def wait(self, timeout: float = 1800) -> None:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        if code:
            raise RuntimeError(f"launch exited with {code}:\n{''.join(self.tail)}")

    def committed(self) -> int:
        return int(self.steps[-1][1].get("flexdemo/committed_steps", 0)) if self.steps else 0


def step_times(steps: list[tuple[float, dict]], skip: int = 3) -> list[float]:
    times = [t for t, _ in steps]
    return [b - a for a, b in zip(times[skip:], times[skip + 1 :])]


class Lighthouse:
    def __init__(self, heartbeat_ms: int, log: Path, join_timeout_ms: int = 2000):
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [
                binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{self.port}",
                "--heartbeat_timeout_ms", str(heartbeat_ms), "--join_timeout_ms", str(join_timeout_ms),
            ],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        time.sleep(1.0)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def ft_env(lighthouse: Lighthouse, node: int) -> dict[str, str]:
    return {"TORCHFT_LIGHTHOUSE": lighthouse.address, "REPLICA_GROUP_ID": str(node), "NUM_REPLICA_GROUPS": "2"}


def t5_small_shapes() -> list[torch.Size]:
    """T5-small's parameter shapes (60.5M parameters), from its config on the meta device."""
    from transformers import T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config())  # t5-small's sizes
    return [p.shape for p in model.parameters()]
