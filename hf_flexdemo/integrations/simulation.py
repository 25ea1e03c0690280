"""``simulate_replicas=R`` in the Trainer: each of R equal parts of a step's micro-batches is one replica.

The Trainer accumulates ``gradient_accumulation_steps`` micro-batches per step, scaling each one's loss
by ``1 / gradient_accumulation_steps`` (or by the step's token count). At the end of each replica's part,
the callback (:class:`~.callback.FlexDeMoCallback`) hands that replica's gradient to the optimizer
(:meth:`hf_flexdemo.FlexDeMo.next_replica`), first scaled by R, so that a replica's gradient is the mean
over its own micro-batches as a node's would be, and clipped to ``max_grad_norm`` as a node clips its own.
AdamW-HSDP's counterpart is the plain accumulation: AdamW on the mean of the R parts' gradients.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainingArguments

from ..optim import FlexDeMo

logger = logging.getLogger(__name__)


def check_simulation_args(args: TrainingArguments, replicas: int) -> None:
    """Before training: the accumulation splits into R equal parts, and the job is one process."""
    if replicas == 1:
        return
    accumulation = args.gradient_accumulation_steps
    if accumulation % replicas:
        multiples = ", ".join(str(replicas * n) for n in range(1, 4))
        raise ValueError(
            f"FlexDeMo: simulate_replicas={replicas} makes each 1/{replicas} of a step's micro-batches one replica, "
            f"but gradient_accumulation_steps={accumulation} does not split into {replicas} equal parts. Set "
            f"--gradient_accumulation_steps to a multiple of {replicas} ({multiples}, ...)."
        )
    if args.world_size > 1:
        raise ValueError(
            f"FlexDeMo: simulate_replicas={replicas} trains every replica in one process, but this job runs "
            f"{args.world_size} processes. Launch one process (python script.py, or accelerate launch "
            "--num_processes 1), or drop simulate_replicas to train across real nodes."
        )


class SimulatedSteps:
    """Hands each simulated replica's gradient to the optimizer as the Trainer's micro-batches go by."""

    def __init__(self, optimizer: FlexDeMo, args: TrainingArguments, replicas: int):
        self.optimizer, self.replicas = optimizer, replicas
        self.micro_steps = args.gradient_accumulation_steps // replicas
        """Micro-batches per replica."""
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._closed = 0  # replicas handed over in this step

    def close_replica(self, args: TrainingArguments) -> None:
        """The gradient in ``.grad`` is the current replica's: scaled, clipped and handed to the optimizer."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.replicas)
            if args.max_grad_norm and args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, args.max_grad_norm)
        self.optimizer.next_replica()
        self._closed += 1

    def close_step(self, args: TrainingArguments, micro_steps: int, step: int) -> None:
        """Before ``optimizer.step()``: the last replica's gradient; replicas a short step left without a
        micro-batch (an epoch's last step) send their momentum with a zero gradient."""
        self.close_replica(args)
        missing = self.replicas - self._closed
        if missing:
            logger.warning(
                "FlexDeMo simulate_replicas=%d: step %d had %d micro-batches, not %d (the epoch's last), so %d "
                "replica(s) take a zero gradient this step. Make the batches per epoch a multiple of "
                "gradient_accumulation_steps to avoid it.",
                self.replicas, step, micro_steps, self.replicas * self.micro_steps, missing,
            )  # fmt: skip
        for _ in range(missing):
            self.optimizer.next_replica()
        self._closed = 0
