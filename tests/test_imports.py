"""What importing hf_flexdemo does: the core alone; the integrations when their library arrives."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.launch import child_env

pytestmark = [pytest.mark.unit, pytest.mark.lowest]


def run_python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]  # other libraries may print notices first


def test_the_optimizer_core_imports_no_other_library_and_patches_nothing():
    out = run_python(
        """
        import sys
        import hf_flexdemo.optim, hf_flexdemo.compression, hf_flexdemo.wire, hf_flexdemo.schemes
        from hf_flexdemo import FlexDeMo, FlexDeMoConfig, CommStats
        print(sorted(m for m in ("transformers", "accelerate", "datasets", "wandb", "evaluate") if m in sys.modules))
        """
    )
    assert out == "[]"


@pytest.mark.parametrize("order", ["hf_flexdemo first", "transformers first"])
def test_optim_flexdemo_works_in_the_stock_trainer_whatever_the_import_order(order):
    first, second = ("hf_flexdemo", "transformers") if order == "hf_flexdemo first" else ("transformers", "hf_flexdemo")
    out = run_python(
        f"""
        import {first}, {second}
        import accelerate.state
        from transformers import TrainingArguments
        args = TrainingArguments("out", optim="flexdemo", optim_args="topk=8", use_cpu=True, report_to="none")
        print(args.optim.value, hasattr(accelerate.state.PartialState.__init__, "__wrapped__"))
        """
    )
    assert out == "flexdemo True"


def test_accelerate_alone_gets_its_plugin_without_transformers():
    out = run_python(
        """
        import sys
        import hf_flexdemo, accelerate.state
        print(hasattr(accelerate.state.PartialState.__init__, "__wrapped__"), "transformers" in sys.modules)
        """
    )
    assert out == "True False"


def test_importing_an_integration_module_directly_installs_everything_after_it():
    out = run_python(
        """
        from hf_flexdemo.integrations.checkpoints import CheckpointCallback  # imports transformers mid-way
        import transformers.trainer
        from transformers import TrainingArguments
        args = TrainingArguments("out", optim="flexdemo", use_cpu=True, report_to="none")
        print(args.optim.value, hasattr(transformers.Trainer.__init__, "__wrapped__"))
        """
    )
    assert out == "flexdemo True"
