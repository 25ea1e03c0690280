"""How long a crash costs: recovery time and lost steps under `accelerate launch --max_restarts`.

Runs `train_t5.py --preset offline` on 2 simulated nodes x 2 processes (`cpu_2x2.yaml`) with
automatic restarts, SIGKILLs one worker per run at a chosen moment, and reads the launcher's
output with timestamps:

- ``recover_s``: from the kill to the first training step logged after the restart (the
  launcher noticing, tearing down and restarting the workers, model build, checkpoint load);
- ``lost_steps``: steps logged before the kill minus the step of the checkpoint resumed from;
- ``launcher_kill``: SIGKILL of the launcher itself; ``stop_s`` is how long its orphaned
  workers took to stop;
- ``save_cost_s``: the median step time with a checkpoint at every step, minus without.

    .venv/bin/python benchmarks/fault_tolerance/restart_recovery.py --repeats 3 \\
        --out benchmarks/results/fault_tolerance/fault_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "accelerate_configs" / "cpu_2x2.yaml"
SCRIPT = ROOT / "training_scripts" / "train_t5.py"
STEP_LINE = re.compile(r"\{'loss'")
RESUMED = re.compile(r"Resuming from .*checkpoint-(\d+)")


class Run:
    """One launch whose output lines are timestamped as they arrive."""

    def __init__(self, output_dir: Path, steps: int, save_steps: int, restarts: int):
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG)]
        if restarts:
            launch += ["--rdzv_backend", "c10d", "--max_restarts", str(restarts)]
        args = f"--preset offline --max_steps {steps} --logging_steps 1 --save_strategy steps --save_steps {save_steps}"
        args += " --max_eval_samples 8 --generation_max_length 8 --output_dir " + str(output_dir)
        args += " --learning_rate 2e-3 --optim_args update=sign"  # as the figures in BENCHMARKS.md were taken
        self.proc = subprocess.Popen(
            [*launch, str(SCRIPT), *args.split()],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            for line in raw.replace("\r", "\n").splitlines():
                self.lines.append((time.monotonic(), line))

    def step_times(self) -> list[float]:
        return [t for t, line in self.lines if STEP_LINE.search(line)]

    def wait_steps(self, count: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while len(self.step_times()) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the run ended before reaching its steps:\n" + self.tail())
            time.sleep(0.01)

    def workers(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def finish(self, timeout: float = 900) -> None:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        if self.proc.returncode != 0:
            raise RuntimeError(f"exit {self.proc.returncode}:\n" + self.tail())

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:])


def worker_kill(tmp: Path, kill_after: int, during_save: bool) -> dict:
    run = Run(tmp, steps=kill_after + 8, save_steps=1 if during_save else 5, restarts=1)
    run.wait_steps(kill_after)
    if during_save:  # the step line is logged just before that step's checkpoint is written
        time.sleep(0.05)
    killed_at = time.monotonic()
    before = len(run.step_times())
    run.workers()[-1].send_signal(signal.SIGKILL)
    run.wait_steps(before + 1)
    first_after = next(t for t in run.step_times() if t > killed_at)
    run.finish()
    resumed = [int(m.group(1)) for _, line in run.lines if (m := RESUMED.search(line))]
    return {
        "fault": "worker SIGKILL during a save" if during_save else "worker SIGKILL mid-run (save every 5 steps)",
        "recover_s": round(first_after - killed_at, 2),
        "lost_steps": before - resumed[0],
        "resumed_from": resumed[0],
    }


def launcher_kill(tmp: Path) -> dict:
    run = Run(tmp, steps=200, save_steps=50, restarts=0)
    run.wait_steps(3)
    orphans = run.workers()
    killed_at = time.monotonic()
    run.proc.send_signal(signal.SIGKILL)
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans):
        if time.monotonic() - killed_at > 60:
            for p in orphans:
                p.kill()
            raise RuntimeError("workers outlived their launcher by 60 s")
        time.sleep(0.02)
    return {"fault": "launcher SIGKILL", "stop_s": round(time.monotonic() - killed_at, 2)}


def step_time(tmp: Path, save_steps: int, steps: int = 16) -> float:
    run = Run(tmp, steps=steps, save_steps=save_steps, restarts=0)
    run.finish()
    times = run.step_times()
    return statistics.median(b - a for a, b in zip(times[2:], times[3:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "fault_tolerance" / "fault_recovery.json"
    )
    args = parser.parse_args()
    results: dict[str, list] = {"runs": [], "save_cost": []}
    for repeat in range(args.repeats):
        for name, measure in (
            ("mid-run", lambda d: worker_kill(d, kill_after=7, during_save=False)),
            ("during-save", lambda d: worker_kill(d, kill_after=6, during_save=True)),
            ("launcher", launcher_kill),
        ):
            with tempfile.TemporaryDirectory(prefix=f"fault-{name}-") as tmp:
                result = measure(Path(tmp))
            print(f"[{repeat + 1}/{args.repeats}] {result}", flush=True)
            results["runs"].append(result)
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            every, never = step_time(Path(a), save_steps=1), step_time(Path(b), save_steps=1000)
        results["save_cost"].append({"step_s_saving_every_step": round(every, 3), "step_s_no_saves": round(never, 3)})
        print(f"[{repeat + 1}/{args.repeats}] {results['save_cost'][-1]}", flush=True)
    summary = {}
    for fault in sorted({r["fault"] for r in results["runs"]}):
        rows = [r for r in results["runs"] if r["fault"] == fault]
        keys = [k for k in rows[0] if k not in ("fault", "resumed_from")]
        summary[fault] = {k: statistics.median(r[k] for r in rows) for k in keys}
    costs = results["save_cost"]
    summary["save_cost_s"] = statistics.median(c["step_s_saving_every_step"] - c["step_s_no_saves"] for c in costs)
    results["median"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
