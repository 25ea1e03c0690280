"""One process of the link benchmark: train_t5.py's Trainer with a step timer.

Launched by ``benchmarks/link/link_benchmark.py`` through ``accelerate launch`` in each simulated
machine; every argument but ``--result`` goes to ``training_scripts/train_t5.py``. The main
process writes the step times, losses, validation loss and FlexDeMo's figures to ``--result``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training_scripts"))

import train_t5  # noqa: E402
from script_utils import finish_distributed  # noqa: E402

from hf_flexdemo import FlexDeMoCallback  # noqa: E402


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step: forward, backward, the exchange and the update."""

    def __init__(self):
        self.times: list[float] = []
        self.comm: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.times.append(time.perf_counter() - self._start)
        stats = getattr(getattr(optimizer, "optimizer", optimizer), "last_step_stats", None)
        self.comm.append(stats.seconds if stats is not None else 0.0)


def main() -> None:
    argv = sys.argv[1:]
    at = argv.index("--result")
    result_path, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2 :]
    trainer = train_t5.build(argv)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    metrics = trainer.evaluate(metric_key_prefix="eval")
    # A FlexDeMo run's figures; AdamW's Trainer has no FlexDeMo callback (the import leaves it stock)
    flexdemo = next((c for c in trainer.callback_handler.callbacks if isinstance(c, FlexDeMoCallback)), None)
    if trainer.is_world_process_zero():
        warm = timer.times[2:]  # the first steps pay for allocation and warm-up
        result = {
            "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
            "optim_args": trainer.args.optim_args,
            "steps": trainer.state.global_step,
            "step_times": timer.times,
            "median_step_s": statistics.median(warm),
            "median_comm_s": statistics.median(timer.comm[2:]),
            "cumulative_s": [sum(timer.times[: i + 1]) for i in range(len(timer.times))],
            "eval_history": [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h],
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_loss": metrics["eval_loss"],
            "figures": flexdemo.figures if flexdemo is not None else {},
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "threads": torch.get_num_threads(),
        }
        result_path.write_text(json.dumps(result, indent=1))
    finish_distributed(trainer)


if __name__ == "__main__":
    main()
