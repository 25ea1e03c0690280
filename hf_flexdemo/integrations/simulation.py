"""``simulate_replicas=R`` in the Trainer: each of R equal parts of a step's micro-batches is one replica.

The Trainer accumulates ``gradient_accumulation_steps`` micro-batches per step, each one's loss divided by the
step's micro-batch count k (or by the step's token count). At the end of each replica's part, the callback
(:class:`~.callback.FlexDeMoCallback`) takes that replica's gradient out of ``.grad``
(:meth:`hf_flexdemo.FlexDeMo.next_replica`). Before the optimizer steps, each replica's gradient is scaled by
k / (its micro-batches), so that it is the mean over its own micro-batches as a node's would be, and clipped to
``max_grad_norm`` on its own, as a node clips its own. AdamW-HSDP's counterpart is the plain accumulation:
AdamW on the mean of the R parts' gradients.
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
        check_simulation_args(args, replicas)  # also for a FlexDeMo handed to the Trainer ready-made
        self.optimizer, self.replicas = optimizer, replicas
        self.micro_steps = args.gradient_accumulation_steps // replicas
        """Micro-batches per replica."""
        self._taken: list[int] = []  # micro-batches of each replica taken this step

    def close_replica(self, micro_steps: int) -> None:
        """The gradient in ``.grad`` is the current replica's (``micro_steps`` micro-batches): take it out."""
        self.optimizer.next_replica()
        self._taken.append(micro_steps)

    def close_step(self, args: TrainingArguments, micro_steps: int, step: int) -> None:
        """Before ``optimizer.step()``: the last replica's gradient taken, every replica's scaled and clipped.
        Replicas that a short step (an epoch's last) left without a micro-batch take a zero gradient."""
        self.close_replica(micro_steps - sum(self._taken))
        missing = self.replicas - len(self._taken)
        if missing:
            logger.warning(
                "FlexDeMo simulate_replicas=%d: step %d had %d micro-batches, not %d (the epoch's last), so %d "
                "replica(s) take a zero gradient this step. Make the batches per epoch a multiple of "
                "gradient_accumulation_steps to avoid it.",
                self.replicas, step, micro_steps, self.replicas * self.micro_steps, missing,
            )  # fmt: skip
            for _ in range(missing):
                self.close_replica(0)
        for grads, taken in zip(self.optimizer.replica_gradients, self._taken):
            if taken:  # the Trainer divided each micro-batch's loss by the step's count
                scale_and_clip([g for g in grads.values() if g is not None], micro_steps / taken, args.max_grad_norm)
        self._taken = []


def scale_and_clip(grads: list[torch.Tensor], scale: float, max_norm: float | None) -> None:
    """``grads *= scale``, then clipped to a total norm of ``max_norm`` (none if 0 or None), in one pass."""
    if not grads:
        return
    if max_norm and max_norm > 0:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) * scale
        scale = (scale * torch.clamp(max_norm / (norm + 1e-6), max=1.0)).to(grads[0].device)  # clip_grad_norm_'s
    torch._foreach_mul_(grads, scale)
