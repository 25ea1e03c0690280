"""Refusals as a user meets them, from the Accelerate YAML or launcher flags a user would write (not a plugin object
built in a test).

Two launches (`accelerate launch` of an unmodified Trainer script): a refusal is said once, by the first process,
in every restart round; and a machine that never comes ends at the launcher's documented timeout. The other
refusals come before any data is loaded, from what the launcher hands its processes: in one process, Accelerate's
own launcher code turns the YAML and flags into the environment each worker gets, and the check reads the plugin
Accelerate builds from it.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from support.launch import REPO_ROOT, TESTS_DIR, child_env, free_port

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


@pytest.mark.multiprocess
def test_a_refusal_is_said_once_by_the_first_process_without_a_traceback_in_every_restart_round(tmp_path):
    """Restarts asked for over the config's static rendezvous (a store shared across rounds) are refused before
    training. torch's agent restarts a refused job like any failed one: every round refuses again, silently after
    the first."""
    from hf_flexdemo.integrations.checkpoints import checkpoints

    returncode, output = launch(tmp_path, CPU_1X2, ["--max_restarts", "1"])
    assert "/attempt_1/0/error.json" in output, output[-3000:]  # the summary is the second round's
    assert_refused_once(returncode, output, "--max_restarts=1 cannot restart this job")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in output and "--rdzv_backend c10d" in output  # what to write
    assert not checkpoints(tmp_path / "out")


@pytest.mark.multiprocess
def test_a_launch_naming_a_machine_that_never_comes_ends_with_the_documented_timeout_flag(tmp_path):
    # The launcher's rendezvous waits for the second machine before any of our code runs: no refusal is
    # possible, so docs/refusals.md names the flag that ends the wait instead of promising one.
    flags = "--num_machines 2 --num_processes 3 --main_process_ip 127.0.0.1 --rdzv_conf timeout=5".split()
    returncode, output = launch(tmp_path, launcher_args=flags)
    assert returncode != 0 and "1/2 clients joined" in output, output[-3000:]
    assert "--rdzv_conf timeout=60" in (REPO_ROOT / "docs" / "refusals.md").read_text()



# -- in one process: the environment the launcher gives its workers ----------------------------------------------


def worker_environment(tmp_path, config: str, flags=()) -> tuple[dict[str, str], SimpleNamespace]:
    """What ``accelerate launch --config_file <config> <flags> script.py`` sets for each worker, from Accelerate's
    own launcher code, and the launch's arguments. (``_validate_launch_command`` is the launcher's private step
    that merges the YAML into the flags; a release that moves it fails here.)"""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    config_file = tmp_path / "accelerate.yaml"
    config_file.write_text(config)
    args = launch_command_parser().parse_args(["--config_file", str(config_file), *flags, str(SCRIPT)])
    args = _validate_launch_command(args)[0]
    if args.use_fsdp:
        return prepare_multi_gpu_env(args), args
    return prepare_simple_launcher_cmd_env(args)[1], args


def refusal_in_a_worker(monkeypatch, environment: dict[str, str], processes: int) -> str:
    """The layout check a worker runs at ``Trainer(...)``, on the plugin and parallelism config that Accelerate
    builds from ``environment``: its message."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    from hf_flexdemo.integrations.accelerate_plugin import check_flexdemo_layout

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    state = SimpleNamespace(
        num_processes=processes,
        distributed_type=DistributedType.FSDP,
        fsdp_plugin=FullyShardedDataParallelPlugin(),
        mixed_precision=environment["ACCELERATE_MIXED_PRECISION"],
        parallelism_config=ParallelismConfig(),
    )
    with pytest.raises(ValueError) as refused:
        check_flexdemo_layout(state)
    return str(refused.value)


@pytest.mark.unit
@pytest.mark.parametrize(
    "yaml_line,flags,strategy",
    [
        ("  fsdp_sharding_strategy: NO_SHARD\n", [], "NO_SHARD"),
        ("", ["--fsdp_sharding_strategy", "4"], "HYBRID_SHARD"),  # FSDP1's number for it
    ],
)
def test_an_fsdp1_sharding_strategy_under_fsdp2_is_refused(tmp_path, monkeypatch, yaml_line, flags, strategy):
    # Accelerate 1.15 leaves plugin.sharding_strategy empty for FSDP2: the value reaches only the environment.
    config = CPU_1X2.replace("  fsdp_version: 2\n", "  fsdp_version: 2\n" + yaml_line)
    environment, args = worker_environment(tmp_path, config, flags)
    message = refusal_in_a_worker(monkeypatch, environment, args.num_processes)
    assert f"fsdp_sharding_strategy={strategy} is an FSDP1 setting" in message
    assert "remove `fsdp_sharding_strategy` from `fsdp_config`" in message


@pytest.mark.unit
def test_a_parallelism_config_bigger_than_the_launch_is_refused_before_torch_builds_the_mesh(tmp_path, monkeypatch):
    config = CPU_2X2.replace("num_processes: 4", "num_processes: 2")
    environment, args = worker_environment(tmp_path, config)
    message = refusal_in_a_worker(monkeypatch, environment, args.num_processes)
    assert "dp_replicate 2 x dp_shard 2 = 4 processes, but this launch started 2" in message
    assert "Write `num_processes: 4`" in message


@pytest.mark.unit
@pytest.mark.parametrize("use_cpu", ["use_cpu: true\n", ""])
def test_multi_cpu_with_two_processes_is_refused_instead_of_training_alone(tmp_path, monkeypatch, use_cpu):
    # Accelerate 1.15 starts MULTI_CPU's processes only through mpirun; without it, one plain process, which
    # refuses when it builds its state, before the process group.
    from accelerate import PartialState

    import hf_flexdemo  # noqa: F401  (its Accelerate plugin)

    config = f"compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n{use_cpu}num_machines: 1\n"
    config += "num_processes: 2\nmixed_precision: 'no'\n"
    environment, _ = worker_environment(tmp_path, config)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as refused:
        PartialState()
    assert "distributed_type: MULTI_CPU with num_processes above 1 started 1 process" in str(refused.value)
    assert "accelerate_configs/cpu_2x2.yaml" in str(refused.value)
