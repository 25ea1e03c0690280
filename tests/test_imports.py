"""What importing hf_flexdemo does: the core alone; the integrations when their library arrives.

Each check needs a fresh interpreter. They start together, in one module fixture, and each test reads its own
process's last line: two cores import two interpreters at once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.launch import child_env

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

SNIPPETS = {
    "core, then accelerate": """
        import sys
        import hf_flexdemo.optim, hf_flexdemo.compression, hf_flexdemo.wire, hf_flexdemo.schemes
        from hf_flexdemo import FlexDeMo, FlexDeMoConfig, CommStats
        core = sorted(m for m in ("transformers", "accelerate", "datasets", "wandb", "evaluate") if m in sys.modules)
        import hf_flexdemo, accelerate.state
        print(core, hasattr(accelerate.state.PartialState.__init__, "__wrapped__"), "transformers" in sys.modules)
        """,
    "hf_flexdemo first": """
        import sys
        import hf_flexdemo, transformers, torch
        import accelerate.state
        from transformers import TrainingArguments
        args = TrainingArguments("out", optim="flexdemo", optim_args="topk=8", use_cpu=True, report_to="none")
        m = torch.nn.Linear(8, 8)
        opt = hf_flexdemo.FlexDeMo(m.parameters(), topk=4, chunk=8)
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        print(args.optim.value, hasattr(accelerate.state.PartialState.__init__, "__wrapped__"), "torchft" in sys.modules)
        """,
    "transformers first": """
        import transformers, hf_flexdemo
        import accelerate.state
        from transformers import TrainingArguments
        args = TrainingArguments("out", optim="flexdemo", optim_args="topk=8", use_cpu=True, report_to="none")
        print(args.optim.value, hasattr(accelerate.state.PartialState.__init__, "__wrapped__"))
        """,
    "an integration module first": """
        from hf_flexdemo.integrations.checkpoints import CheckpointCallback  # imports transformers mid-way
        import transformers.trainer
        from transformers import TrainingArguments
        args = TrainingArguments("out", optim="flexdemo", use_cpu=True, report_to="none")
        print(args.optim.value, hasattr(transformers.Trainer.__init__, "__wrapped__"))
        """,
}


@pytest.fixture(scope="module")
def last_lines(tmp_path_factory) -> dict[str, str]:
    cwd = tmp_path_factory.mktemp("imports")
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=cwd,
        )
        for name, code in SNIPPETS.items()
    }
    lines = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{name}:\n{err[-3000:]}"
        lines[name] = out.strip().splitlines()[-1]  # other libraries may print notices first
    return lines


def test_the_optimizer_core_imports_no_other_library_and_accelerate_alone_gets_its_plugin(last_lines):
    assert last_lines["core, then accelerate"] == "[] True False"


@pytest.mark.parametrize("order", ["hf_flexdemo first", "transformers first"])
def test_optim_flexdemo_works_in_the_stock_trainer_whatever_the_import_order(last_lines, order):
    assert last_lines[order].startswith("flexdemo True")


def test_without_fault_tolerance_torchft_is_never_imported(last_lines):
    assert last_lines["hf_flexdemo first"] == "flexdemo True False"  # a FlexDeMo step taken, torchft not imported


def test_importing_an_integration_module_directly_installs_everything_after_it(last_lines):
    assert last_lines["an integration module first"] == "flexdemo True"
