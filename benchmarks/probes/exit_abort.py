"""How often a gloo job's process aborts at exit ("terminate called without an active exception"), by how it exits.

Issue 47: one worker of a plain 2 x 2 T5 run ended in SIGABRT after training, evaluating and saving.
The cause (pytorch/pytorch#190489): torch's gloo groups outlive ``destroy_process_group()`` (a gloo
group has no ``shutdown()`` that stops its threads, and the device mesh and FSDP's state still hold
it); a gloo worker thread that drops the last reference to a finished collective frees its tensors,
which takes the GIL, and if the interpreter's teardown has begun, Python ends that thread inside a
``noexcept`` destructor: ``std::terminate``. A loaded machine widens the window.

Two jobs, each run ``--runs`` times beside ``--burners`` CPU-bound processes:

- ``probe``: 4 plain gloo processes in a 2 x 2 layout, each 30 rounds of asynchronous all-gathers on
  its pair's group; then a barrier, ``destroy_process_group()``, and the exit under test. The race,
  with nothing else around it.
- ``t5``: the ready-made T5 script, 2 nodes x 2 processes (``accelerate_configs/cpu_2x2.yaml``), as
  ``tests/test_crash_safety.py::test_load_best_model_at_end_...`` launches it (saves and evaluations
  every 2 steps, the best model loaded at the end), 4 steps instead of 10.

``--exit teardown`` ends a probe process by returning from its script (Python's teardown);
``exit_worker`` as ``training_scripts/script_utils.py``'s ``exit_worker()`` does (the exit handlers,
then no teardown). The T5 script always exits through ``exit_worker()``.

    .venv/bin/python benchmarks/probes/exit_abort.py --job probe --exit teardown --runs 100
    .venv/bin/python benchmarks/probes/exit_abort.py --job probe --exit exit_worker --runs 100
    .venv/bin/python benchmarks/probes/exit_abort.py --job t5 --runs 50
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "training_scripts"))

PROBE = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
mine = pairs[rank // 2]
for _ in range(30):
    source = torch.randn(4096)
    gathered = torch.empty(2 * 4096)
    dist.all_gather_into_tensor(gathered, source, group=mine, async_op=True).wait()
dist.barrier()
dist.destroy_process_group()
if sys.argv[1] == "exit_worker":
    sys.path.insert(0, sys.argv[2])
    import script_utils
    script_utils._LEFT_THE_JOB = True  # as finish_distributed() leaves it
    script_utils.exit_worker()
"""

T5_FLAGS = [
    "--preset", "offline", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
    "--max_eval_samples", "16", "--generation_max_length", "16", "--seed", "3", "--load_best_model_at_end",
    "--eval_strategy", "steps", "--eval_steps", "2", "--metric_for_best_model", "loss", "--predict_with_generate",
    "false", "--report_to", "none",
]  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_probe(exit_mode: str, env: dict[str, str]) -> tuple[list[int], str]:
    port = free_port()
    procs = []
    for rank in range(4):
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PROBE, exit_mode, str(ROOT / "training_scripts")],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], "".join(outputs)


def run_t5(env: dict[str, str], work: Path) -> tuple[list[int], str]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "accelerate_configs" / "cpu_2x2.yaml"), "--main_process_port", str(free_port()),
        str(ROOT / "training_scripts" / "train_t5.py"), "--output_dir", str(work), *T5_FLAGS,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return [done.returncode], done.stdout + done.stderr


def burn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=["probe", "t5"], default="probe")
    parser.add_argument("--exit", choices=["teardown", "exit_worker"], default="exit_worker")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside the job")
    parser.add_argument("--out", type=Path, help="append the tally here (JSON lines)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    burners = [burn() for _ in range(args.burners)]
    aborted, failed, seconds = 0, 0, []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in tqdm(range(args.runs), desc=f"{args.job}, {args.exit}"):
                started = time.time()
                if args.job == "probe":
                    codes, output = run_probe(args.exit, env)
                else:
                    codes, output = run_t5(env, Path(tmp) / f"run{run}")
                seconds.append(time.time() - started)
                if "terminate called" in output or -6 in codes:
                    aborted += 1
                    tqdm.write(f"run {run}: abort ({codes})\n{output[-2000:]}")
                elif any(codes):
                    failed += 1
                    tqdm.write(f"run {run}: failed ({codes})\n{output[-6000:]}")
                else:
                    tqdm.write(f"run {run}: clean exit ({seconds[-1]:.1f} s)")
    finally:
        for burner in burners:
            burner.kill()
    exit_mode = "exit_worker" if args.job == "t5" else args.exit
    tally = dict(job=args.job, exit=exit_mode, runs=args.runs, burners=args.burners, aborted=aborted, failed=failed,
                 median_s=sorted(seconds)[len(seconds) // 2])  # fmt: skip
    print(json.dumps(tally))
    if args.out:
        with args.out.open("a") as out:
            out.write(json.dumps(tally) + "\n")


if __name__ == "__main__":
    main()
