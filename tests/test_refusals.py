"""An uncaught refusal prints its message once, without a traceback; every other error keeps its traceback.
Also the refusals that read only the launcher's environment.

The launches under `accelerate launch` are in tests/test_refusal_launches.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.launch import child_env

from hf_flexdemo.config import parse_optim_args
from hf_flexdemo.refusals import RefusalHook

pytestmark = pytest.mark.unit

REFUSED = "import torch, hf_flexdemo; hf_flexdemo.FlexDeMo([torch.nn.Parameter(torch.zeros(4))], topk=0)"


def test_a_refusal_prints_its_message_and_the_variable_that_brings_the_traceback_back():
    proc = subprocess.run([sys.executable, "-c", REFUSED], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "hf_flexdemo refused this run: FlexDeMo: topk=0 is invalid" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "HF_FLEXDEMO_TRACEBACK=1 shows the traceback" in proc.stderr


def raised(call, *args) -> BaseException:
    try:
        call(*args)
    except Exception as error:
        return error
    raise AssertionError(f"{call} raised nothing")


def hook_output(error: BaseException, capsys) -> tuple[str, list]:
    """What the hook prints for ``error``, and what it handed on to the previous hook."""
    handed_on: list = []
    RefusalHook(lambda *info: handed_on.append(info))(type(error), error, error.__traceback__)
    return capsys.readouterr().err, handed_on


def test_the_variable_brings_the_traceback_back(monkeypatch, capsys):
    monkeypatch.setenv("HF_FLEXDEMO_TRACEBACK", "1")
    printed, handed_on = hook_output(raised(parse_optim_args, "topk=0x"), capsys)
    assert printed == "" and len(handed_on) == 1


def test_other_processes_of_a_launch_exit_quietly(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    printed, handed_on = hook_output(raised(parse_optim_args, "topk=0x"), capsys)
    assert printed == "" and len(handed_on) == 1  # handed on with its output dropped (wandb marks its run failed)


def test_a_value_error_raised_outside_hf_flexdemo_keeps_its_traceback(capsys):
    printed, handed_on = hook_output(raised(int, "x"), capsys)
    assert printed == "" and len(handed_on) == 1


def test_hf_flexdemos_own_errors_are_said_with_their_class_name(tmp_path, capsys):
    # Raised by hf_flexdemo, not a ValueError: a run stopped, said in one line with the class name.
    from hf_flexdemo.integrations.checkpoints import check_writable

    (tmp_path / "file").touch()
    printed, handed_on = hook_output(raised(check_writable, tmp_path / "file" / "out"), capsys)
    assert printed.startswith("hf_flexdemo stopped this run: CheckpointStorageError: output_dir=")
    assert "Traceback" not in printed and len(handed_on) == 1


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


def test_the_launchers_root_cause_is_the_refusal(monkeypatch, tmp_path, capsys):
    # torchelastic's summary shows a worker's error file as its "Root Cause"; without it, "To enable traceback see".
    import json

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "0")
    hook_output(raised(parse_optim_args, "topk=0x"), capsys)
    message = json.loads(error_file.read_text())["message"]
    assert message.startswith("hf_flexdemo refused this run: FlexDeMo optim_args: topk='0x' is not int")
    assert "HF_FLEXDEMO_TRACEBACK=1" in message


def test_a_refusal_is_printed_once_across_the_launchers_restart_rounds(monkeypatch, tmp_path, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_RANK", "0")
    printed = []
    for restart, optim_args in ((0, "topk=0x"), (1, "topk=0x"), (2, "chunk=0x")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        printed.append(hook_output(raised(parse_optim_args, optim_args), capsys)[0])
    assert "topk='0x'" in printed[0] and printed[1] == "" and "chunk='0x'" in printed[2]  # a new refusal is said


WANDB_THEN_REFUSED = """
import sys, torch, wandb, hf_flexdemo
from hf_flexdemo import refusals
wandb.init(mode="offline", dir=sys.argv[1], project="refusals")  # puts its excepthook above ours
refusals.install()  # what the Trainer glue does at a run's first step
hf_flexdemo.FlexDeMo([torch.nn.Parameter(torch.zeros(4))], topk=0)
"""


def test_a_refusal_after_wandb_init_is_said_once_without_wandbs_traceback(tmp_path):
    pytest.importorskip("wandb")  # installed with the project; a machine without it (the GPU one) skips
    # wandb's hook prints the traceback, then hands on to the hook it found (ours, installed at import).
    command = [sys.executable, "-c", WANDB_THEN_REFUSED, str(tmp_path)]
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("hf_flexdemo refused this run: FlexDeMo: topk=0 is invalid") == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_hook_put_above_ours_still_hears_a_refusal_but_prints_nothing(monkeypatch, capsys):
    from hf_flexdemo import refusals

    heard = []

    def later_hook(kind, error, tb):  # as wandb's: record, print a traceback, hand on
        heard.append(error)
        print("Traceback (most recent call last): ...", file=sys.stderr)
        below(kind, error, tb)

    below = RefusalHook(lambda *info: None)
    monkeypatch.setattr(sys, "excepthook", later_hook)
    monkeypatch.setenv("LOCAL_RANK", "0")
    refusals.install()
    error = raised(parse_optim_args, "topk=0x")
    sys.excepthook(type(error), error, error.__traceback__)
    printed = capsys.readouterr().err
    assert heard == [error] and "Traceback" not in printed and printed.count("hf_flexdemo refused this run") == 1


def test_the_trainer_callback_puts_the_hook_back_on_top_once_a_run(monkeypatch):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_flexdemo import refusals
    from hf_flexdemo.integrations.callback import FlexDeMoCallback

    calls = []
    monkeypatch.setattr(refusals, "install", lambda: calls.append(1))
    callback, args = FlexDeMoCallback(), TrainingArguments("unused", use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    for _ in range(2):  # two training runs of one Trainer
        callback.on_train_begin(args, state, control, optimizer=None)
        for _ in range(3):
            callback.on_step_begin(args, state, control)
    assert len(calls) == 2  # at each run's first step (after wandb.init in the reporters' on_train_begin)
