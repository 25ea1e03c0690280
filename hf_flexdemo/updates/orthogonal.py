"""``orthogonal``: replace each matrix's decoded update by its nearest semi-orthogonal matrix.

As Muon does, but on DeMo's decoded update (arXiv 2502.16982; Dion, arXiv 2504.05295, for the
sharded case). For a 2-D parameter with decoded update ``U`` (``rows x cols``)::

    O  = NS(U)                           Newton-Schulz: U's singular values pushed towards 1
    p -= lr * sqrt(max(rows, cols)) * O

The factor makes the step's root mean square about 1 per entry, the size of a sign step, so
a learning rate tuned for ``sign`` is the right order here. Tensors that are not 2-D (norms,
biases, convolution kernels) take the element-wise rule ``elementwise_update`` (``sign``, or
``adam`` as Muon leaves them to AdamW); embeddings and output heads should too, and the
Trainer integration puts them in groups of their own with that rule (a plain-PyTorch user
passes ``elementwise=`` or such a group).

Under FSDP2 each process holds a row shard of the matrix. The shards of every matrix of the
step are gathered in one all-gather over the node's own processes (the fast link, never the
inter-node one); every process then orthogonalizes the whole matrices in float32 and keeps
its rows. Every replica gathers the same update and runs the same arithmetic, so replicas
stay bitwise identical.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..config import FlexDeMoConfig
from ..schemes.base import StepContext
from ..topology import all_gather_single
from .adam import AdamRule
from .base import Decoded, UpdateRule
from .sign import SignRule

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic of Muon's Newton-Schulz iteration: fast growth of small singular values."""
NS_STEPS = 5


def newton_schulz(matrix: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with ``matrix``'s singular vectors (float32)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(torch.float32)
    # Singular values into [0, 1], where the iteration converges; the update's scale (lr * grad) can be
    # tiny, so the guard against a zero matrix must not be a fixed epsilon.
    x = x / (x.norm() + torch.finfo(torch.float32).tiny)
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.T  # iterate on the smaller Gram matrix
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def _row_shards(param: torch.Tensor) -> tuple[dist.ProcessGroup, int, int] | None:
    """(group, size, rank) of the processes that hold ``param``'s rows; None if this process holds all."""
    if not isinstance(param, DTensor) or param.device_mesh.size() == 1:
        return None
    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(
            f"FlexDeMo: update='orthogonal' needs matrices sharded by rows on one mesh dimension (FSDP2's "
            f"default), but a parameter of shape {tuple(param.shape)} has placements {tuple(param.placements)} on "
            f"a {mesh.ndim}-D mesh. Use update='sign' or 'adam' for it (a parameter group of its own)."
        )
    return mesh.get_group(0), mesh.size(), mesh.get_local_rank(0)


class OrthogonalRule(UpdateRule):
    name = "orthogonal"

    def __init__(self, config: FlexDeMoConfig):
        super().__init__(config)
        self.elementwise = (AdamRule if config.elementwise_update == "adam" else SignRule)(config)
        self.state_keys = self.elementwise.state_keys

    def init_state(self, slot) -> None:
        if slot.state.param.dim() != 2:
            self.elementwise.init_state(slot)

    def check_state(self, slot) -> None:
        if slot.state.param.dim() == 2:
            _row_shards(slot.state.param)  # refuse a layout it cannot gather before anything moves

    @staticmethod
    def is_matrix(item: Decoded) -> bool:
        return item.slot.state.param.dim() == 2 and item.where is None

    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        matrices = [item for item in decoded if self.is_matrix(item)]
        self.elementwise.apply([item for item in decoded if not self.is_matrix(item)], ctx)
        by_group: dict[object, list[Decoded]] = defaultdict(list)
        for item in matrices:
            shards = _row_shards(item.slot.state.param)
            if shards is None:
                self._step(item, item.update.view(item.slot.param.shape))
            else:
                by_group[shards].append(item)
        for (group, size, rank), items in by_group.items():
            for item, whole in zip(items, _gather_rows(items, group, size)):
                rows = item.slot.param.shape[0]
                start = rank * math.ceil(whole.shape[0] / size)
                self._step(item, whole, keep=slice(start, start + rows))

    def _step(self, item: Decoded, whole: torch.Tensor, keep: slice = slice(None)) -> None:
        rows, cols = whole.shape
        ortho = newton_schulz(whole)[keep]
        self.subtract(item, ortho.mul_(math.sqrt(max(rows, cols))))


def _gather_rows(items: list[Decoded], group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    """Every matrix's whole update, from the row shards of its ``size`` processes, in one all-gather.

    FSDP2 splits rows as ``torch.chunk`` does: ``ceil(rows / size)`` per process, the last ones
    shorter or empty. Each shard travels padded to that size so every process sends alike.
    """
    shapes, pieces = [], []
    for item in items:
        rows, cols = item.slot.state.param.shape
        per_rank = math.ceil(rows / size)
        local = item.update.view(item.slot.param.shape).to(torch.float32)
        padded = local.new_zeros(per_rank, cols)
        padded[: local.shape[0]] = local
        shapes.append((rows, cols, per_rank))
        pieces.append(padded.reshape(-1))
    flat = torch.cat(pieces)
    gathered = flat.new_empty(size * flat.numel())
    all_gather_single(gathered, flat, group=group)
    gathered = gathered.view(size, flat.numel())
    wholes, start = [], 0
    for rows, cols, per_rank in shapes:
        block = gathered[:, start : start + per_rank * cols].reshape(size * per_rank, cols)
        wholes.append(block[:rows])
        start += per_rank * cols
    return wholes
