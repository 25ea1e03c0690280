"""Refusals as a user meets them: `accelerate launch` of an unmodified Trainer script with the
Accelerate YAML or launcher flags a user would write (not a plugin object built in a test).

Each refused launch stops at `Accelerator()` or `Trainer(...)`, before any data is loaded.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.launch import REPO_ROOT, TESTS_DIR, child_env, free_port

pytestmark = pytest.mark.multiprocess

SCRIPT = TESTS_DIR / "workers" / "plain_trainer_script.py"
CPU_2X2 = (TESTS_DIR / "configs" / "cpu_2x2.yaml").read_text()
CPU_1X2 = (TESTS_DIR / "configs" / "cpu_1x2.yaml").read_text()
"""Half the start-up cost, where the layout does not matter."""
LAUNCHER_TRACEBACK_END = "errors.ChildFailedError:"
"""The launcher's own summary ends its traceback with this; workers' tracebacks do not."""
ROOT_CAUSE = "Root Cause (first observed failure):"
"""Where the launcher's summary names the failure it blames (from the worker's error file)."""


def launch(tmp_path, config: str = CPU_2X2, launcher_args=(), script_args=(), **env: str):
    """``accelerate launch --config_file <config> -m hf_flexdemo.run plain_trainer_script.py ...``, one step."""
    config_file = tmp_path / "accelerate.yaml"
    config_file.write_text(config)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
        "--main_process_port", str(free_port()), *launcher_args, "-m", "hf_flexdemo.run", str(SCRIPT),
        "--optim", "flexdemo", "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none",
        "--output_dir", str(tmp_path / "out"), *script_args,
    ]  # fmt: skip
    proc = subprocess.run(command, env=child_env(**env), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def assert_refused_once(returncode: int, output: str, message: str) -> None:
    """Said once by the first process, and once more as the root cause in the launcher's closing summary."""
    assert returncode != 0, output[-3000:]
    said, _, summary = output.partition(ROOT_CAUSE)
    assert said.count(message) == 1, output[-6000:]
    assert "traceback : hf_flexdemo refused this run: " in summary and message in summary, summary
    assert output.count("Traceback (most recent call last)") == output.count(LAUNCHER_TRACEBACK_END), output[-6000:]
    assert "HF_FLEXDEMO_TRACEBACK=1" in output


def test_a_refusal_is_said_once_by_the_first_process_without_a_traceback_in_every_restart_round(tmp_path):
    # torch's agent restarts a refused job like any failed one: every round refuses again, silently after the first.
    flags = ["--rdzv_backend", "c10d", "--max_restarts", "1"]
    returncode, output = launch(
        tmp_path, CPU_1X2, flags, ["--optim_args", "value_bits=3"], TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )
    assert "/attempt_1/0/error.json" in output, output[-3000:]  # the summary is the second round's
    assert_refused_once(returncode, output, "value_bits=3 is invalid; value_bits must be one of (0, 1, 2, 4, 8)")


@pytest.mark.parametrize(
    "yaml_line,flags,strategy",
    [
        ("  fsdp_sharding_strategy: NO_SHARD\n", [], "NO_SHARD"),
        ("", ["--fsdp_sharding_strategy", "4"], "HYBRID_SHARD"),  # FSDP1's number for it
    ],
)
def test_an_fsdp1_sharding_strategy_under_fsdp2_is_refused(tmp_path, yaml_line, flags, strategy):
    # Accelerate 1.15 leaves plugin.sharding_strategy empty for FSDP2: the value reaches only the environment.
    config = CPU_1X2.replace("  fsdp_version: 2\n", "  fsdp_version: 2\n" + yaml_line)
    returncode, output = launch(tmp_path, config, launcher_args=flags)
    assert_refused_once(returncode, output, f"fsdp_sharding_strategy={strategy} is an FSDP1 setting")
    assert "remove `fsdp_sharding_strategy` from `fsdp_config`" in output


def test_a_parallelism_config_bigger_than_the_launch_is_refused_before_torch_builds_the_mesh(tmp_path):
    config = CPU_2X2.replace("num_processes: 4", "num_processes: 2")
    returncode, output = launch(tmp_path, config)
    assert_refused_once(returncode, output, "dp_replicate 2 x dp_shard 2 = 4 processes, but this launch started 2")
    assert "Write `num_processes: 4`" in output and "Mesh should not be bigger" not in output


def test_a_launch_naming_a_machine_that_never_comes_ends_with_the_documented_timeout_flag(tmp_path):
    # The launcher's rendezvous waits for the second machine before any of our code runs: no refusal is
    # possible, so docs/refusals.md names the flag that ends the wait instead of promising one.
    flags = "--num_machines 2 --num_processes 3 --main_process_ip 127.0.0.1 --rdzv_conf timeout=5".split()
    returncode, output = launch(tmp_path, launcher_args=flags)
    assert returncode != 0 and "1/2 clients joined" in output, output[-3000:]
    assert "--rdzv_conf timeout=60" in (REPO_ROOT / "docs" / "refusals.md").read_text()


@pytest.mark.parametrize("use_cpu", ["use_cpu: true\n", ""])
def test_multi_cpu_with_two_processes_is_refused_instead_of_training_alone(tmp_path, use_cpu):
    # Accelerate 1.15 starts MULTI_CPU's processes only through mpirun; without it, one plain process.
    config = f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n{use_cpu}num_machines: 1\n"
    config += "num_processes: 2\nmixed_precision: 'no'\n"
    returncode, output = launch(tmp_path, config)
    message = "distributed_type: MULTI_CPU with num_processes above 1 started 1 process"
    assert returncode != 0 and output.count(message) == 1, output[-3000:]
    assert "accelerate_configs/cpu_2x2.yaml" in output and "Traceback" not in output.partition(message)[0]
