"""FlexDeMo in layouts that would train wrong must be refused (run with torchrun, 2 processes, CPU).

argv[1] is the case; the message of the expected error goes to argv[2]/rank<N>.txt.
"""

import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

import hf_flexdemo


def main():
    case, out = sys.argv[1], Path(sys.argv[2])
    os.environ["ACCELERATE_USE_CPU"] = "true"
    message = "no error"
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
        message = str(e)
    (out / f"rank{os.environ['RANK']}.txt").write_text(message)


if __name__ == "__main__":
    main()
