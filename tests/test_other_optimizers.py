"""``import hf_flexdemo`` leaves a Trainer with another optimizer as stock transformers has it (issue 71).

The same plain AdamW script (tests/workers/adamw_trainer_script.py) runs in two fresh interpreters, started
together: one as it is, one with ``import hf_flexdemo`` at the top. Both must run the same steps with the same
losses, write the same files, give the Trainer the same callbacks, treat ``bf16`` and a T5 model alike, and
behave alike when the script runs again in the same ``output_dir`` with more steps (stock transformers starts over).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.launch import TESTS_DIR, child_env

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

SCRIPT = TESTS_DIR / "workers" / "adamw_trainer_script.py"
SIDES = {"stock": [], "with hf_flexdemo": ["--import-hf-flexdemo"]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("other_optimizers")
    procs = {}
    for side, flags in SIDES.items():
        folder = root / side.replace(" ", "_")
        command = [sys.executable, str(SCRIPT), str(folder), str(folder / "report.json"), *flags]
        procs[side] = (
            folder,
            subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
        )
    found = {}
    for side, (folder, proc) in procs.items():
        output = proc.communicate(timeout=300)[0].decode(errors="replace")
        assert proc.returncode == 0, f"{side}:\n{output[-4000:]}"
        found[side] = json.loads((folder / "report.json").read_text())
    assert [found[side]["patched"] for side in SIDES] == [False, True]
    return found


def test_the_user_scenario_starts_over_as_stock_does(reports):
    stock, ours = reports["stock"], reports["with hf_flexdemo"]
    assert stock["again"].get("raised") is None, stock["again"]  # stock: no resume unless asked, starts over
    assert ours["again"].get("raised") is None, ours["again"]
    for run in ("first", "again"):
        assert ours[run]["global_step"] == stock[run]["global_step"]
        assert ours[run]["losses"] == stock[run]["losses"], run
    assert [step for step, _ in stock["again"]["losses"]] == list(range(1, 7))


def test_the_same_files_are_written(reports):
    stock, ours = reports["stock"]["files"], reports["with hf_flexdemo"]["files"]
    assert "checkpoint-6/trainer_state.json" in stock
    assert ours == stock


def test_the_trainer_gets_the_same_callbacks(reports):
    for run in ("first", "again"):
        assert reports["with hf_flexdemo"][run]["callbacks"] == reports["stock"][run]["callbacks"]
    assert "FlexDeMoCallback" not in reports["with hf_flexdemo"]["first"]["callbacks"]


def test_bf16_is_left_to_transformers(reports):
    # Stock transformers refuses bf16 without a bf16 device unless use_cpu is set: the same error type then.
    assert reports["with hf_flexdemo"]["bf16"] == reports["stock"]["bf16"]


def test_a_t5_model_is_not_marked(reports):
    assert reports["with hf_flexdemo"]["t5"] == reports["stock"]["t5"]
    assert reports["with hf_flexdemo"]["t5"]["marked"] is None
