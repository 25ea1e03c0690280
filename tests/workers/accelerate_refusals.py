"""FlexDeMo in layouts that would train wrong must be refused (run with torchrun, 2 processes, CPU).

argv[1] lists the cases, run in turn in these processes; each case's error message goes to
argv[2]/rank<N>_<case>.txt. The FSDP1 cases are refused while the Accelerate plugin is built, before any
state exists, so they come first; the environment they set is cleared before the next case.
"""

import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import hf_flexdemo

FSDP1_VARIABLES = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_SHARDING_STRATEGY", "FSDP_SYNC_MODULE_STATES")


def refusal(case: str) -> str:
    try:
        if case == "ddp":  # multi-CPU DDP: every gradient would be all-reduced densely
            accelerator = Accelerator()
            model = torch.nn.Linear(4, 4)
            accelerator.prepare(model, hf_flexdemo.FlexDeMo(model.parameters()))
        elif case.startswith("fsdp1"):  # FSDP1 on CPU: HYBRID_SHARD would fall back to unsynchronized copies
            os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="1", FSDP_SHARDING_STRATEGY="HYBRID_SHARD")
            if case == "fsdp1_sync_module_states":  # Accelerate's own check used to speak first, about devices
                os.environ["FSDP_SYNC_MODULE_STATES"] = "true"
            Accelerator()
    except ValueError as e:
        return str(e)
    finally:
        for name in FSDP1_VARIABLES:
            os.environ.pop(name, None)
        AcceleratorState._reset_state()  # the next case builds its own Accelerator
    return "no error"


def main():
    cases, out = sys.argv[1].split(","), Path(sys.argv[2])
    os.environ["ACCELERATE_USE_CPU"] = "true"
    for case in cases:
        (out / f"rank{os.environ['RANK']}_{case}.txt").write_text(refusal(case))


if __name__ == "__main__":
    main()
