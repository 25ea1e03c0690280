"""An uncaught refusal prints its message once, without a traceback; every other error keeps its traceback.
Also the refusals that read only the launcher's environment.

The launches under `accelerate launch` are in tests/test_refusal_launches.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.launch import child_env

pytestmark = pytest.mark.unit

REFUSED = "import torch, hf_flexdemo; hf_flexdemo.FlexDeMo([torch.nn.Parameter(torch.zeros(4))], topk=0)"
MESSAGE = "topk=0 is invalid"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=child_env(**env), capture_output=True, text=True, timeout=120
    )


def test_a_refusal_prints_its_message_and_the_variable_that_brings_the_traceback_back():
    proc = run(REFUSED)
    assert proc.returncode == 1
    assert MESSAGE in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "HF_FLEXDEMO_TRACEBACK=1 shows the traceback" in proc.stderr


def test_the_variable_brings_the_traceback_back():
    proc = run(REFUSED, HF_FLEXDEMO_TRACEBACK="1")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and MESSAGE in proc.stderr, proc.stderr


def test_other_processes_of_a_launch_exit_quietly_with_the_same_code():
    proc = run(REFUSED, LOCAL_RANK="1", RANK="1")
    assert proc.returncode == 1 and proc.stderr.strip() == "", proc.stderr


def test_a_value_error_raised_outside_hf_flexdemo_keeps_its_traceback():
    proc = run("import hf_flexdemo; int('x')")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "refused" not in proc.stderr, proc.stderr


def test_nodes_launched_with_different_numbers_of_processes_are_refused_on_every_node(monkeypatch):
    # Machine 0 with 2 processes, machine 1 with 1: WORLD_SIZE=3 divides evenly by machine 1's 1.
    from hf_flexdemo.integrations.accelerate_plugin import default_layout

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE=3 processes on GROUP_WORLD_SIZE=2 nodes.*same --num_processes"):
        default_layout()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert default_layout() == (2, 1)


@pytest.mark.parametrize("value,write", [("shard_grad_op", "fsdp_reshard_after_forward: false"), ("no_shard", "true")])
def test_an_fsdp1_reshard_value_under_fsdp2_is_refused_with_its_fsdp2_spelling(monkeypatch, value, write):
    # What `accelerate launch` passes for `fsdp_reshard_after_forward: SHARD_GRAD_OP` in the YAML.
    from accelerate.utils import FullyShardedDataParallelPlugin

    import hf_flexdemo  # noqa: F401  (the plugin's checks)

    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", value)
    with pytest.raises(ValueError, match=f"fsdp_reshard_after_forward={value.upper()} is FSDP1's spelling.*{write}"):
        FullyShardedDataParallelPlugin()


def test_hf_flexdemos_own_errors_keep_their_class_name_in_the_line(tmp_path):
    # Raised by hf_flexdemo, not a ValueError: a run stopped, said in one line with the class name.
    (tmp_path / "file").touch()
    unwritable = str(tmp_path / "file" / "out")
    proc = run(f"from hf_flexdemo.integrations.checkpoints import check_writable; check_writable({unwritable!r})")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "hf_flexdemo stopped this run: CheckpointStorageError: output_dir=" in proc.stderr
