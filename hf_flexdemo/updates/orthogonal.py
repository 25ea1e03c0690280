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

Under FSDP2 each process holds a row shard of the matrix. Each matrix has one owner among the
node's processes (the matrices are dealt out by size, so the owners share the work evenly):
one all-to-all over the node's own processes (the fast link, never the inter-node one) brings
every owner the row shards of its matrices, the owner orthogonalizes them whole in float32,
and a second all-to-all sends each process its rows back. A node thus runs Newton-Schulz once
per matrix, not once per process, and no process holds more whole matrices than it owns.
Every replica deals the same matrices to the same local ranks and runs the same arithmetic on
the same update, so replicas stay bitwise identical.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..config import FlexDeMoConfig
from ..schemes.base import StepContext
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
            _row_shards(slot.state.param)  # refuse a layout it cannot deal out before anything moves

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
                self.subtract(item, scaled_newton_schulz(item.update.view(item.slot.param.shape)))
            else:
                by_group[shards].append(item)
        for (group, size, rank), items in by_group.items():
            for item, ortho in zip(items, _orthogonalize_by_owner(items, group, size, rank)):
                self.subtract(item, ortho)


def scaled_newton_schulz(whole: torch.Tensor) -> torch.Tensor:
    """``sqrt(max(rows, cols)) * NS(whole)`` in float32: a step of about one per entry, as a sign step."""
    rows, cols = whole.shape
    return newton_schulz(whole).mul_(math.sqrt(max(rows, cols)))


@functools.lru_cache(maxsize=16)  # the same shapes every step: dealt once per group
def deal_owners(numels: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Each matrix's owner among ``size`` processes: largest first, to the least loaded (ties: lowest rank).

    Depends on the shapes alone, so every process and every replica deals alike.
    """
    load, owners = [0] * size, [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owner = min(range(size), key=lambda rank: (load[rank], rank))
        owners[index] = owner
        load[owner] += numels[index]
    return tuple(owners)


def _orthogonalize_by_owner(items: list[Decoded], group: dist.ProcessGroup, size: int, rank: int) -> list[torch.Tensor]:
    """This process's rows of each matrix's scaled orthogonalization, each matrix computed by its owner.

    FSDP2 splits rows as ``torch.chunk`` does: ``ceil(rows / size)`` per process, the last ones shorter or
    empty. Each shard travels padded to that size, so a process sends every owner the same amount.
    """
    shapes = [tuple(item.slot.state.param.shape) for item in items]
    per_rank = [math.ceil(rows / size) for rows, _ in shapes]
    block = [per * cols for per, (_, cols) in zip(per_rank, shapes)]  # one padded shard, in entries
    owners = deal_owners(tuple(rows * cols for rows, cols in shapes), size)
    owned_by = [[i for i, owner in enumerate(owners) if owner == q] for q in range(size)]
    shards = []
    for item, per, (_, cols) in zip(items, per_rank, shapes):
        local = item.update.view(item.slot.param.shape).to(torch.float32)
        padded = local.new_zeros(per, cols)
        padded[: local.shape[0]] = local
        shards.append(padded)
    # Out: to each owner q, this process's shard of each matrix q owns (in matrix order).
    sent = torch.cat([shards[i].reshape(-1) for q in range(size) for i in owned_by[q]])
    mine = owned_by[rank]
    sizes_to_owners = [sum(block[i] for i in owned_by[q]) for q in range(size)]
    sizes_of_mine = [sum(block[i] for i in mine)] * size
    received = _all_to_all(sent, send=sizes_to_owners, receive=sizes_of_mine, group=group)
    # Every source sent its shards of my matrices in the same order, source q's rows q-th.
    results, start = [], 0
    for i in mine:
        (rows, cols), per = shapes[i], per_rank[i]
        whole = received.view(size, -1)[:, start : start + block[i]].reshape(size * per, cols)[:rows]
        ortho = whole.new_zeros(size * per, cols)
        ortho[:rows] = scaled_newton_schulz(whole)
        results.append(ortho.view(size, block[i]))
        start += block[i]
    # Back: to each process q, its rows of every matrix this process owns, in the same order.
    back = torch.cat(results, dim=1).reshape(-1) if results else sent.new_empty(0)
    returned = _all_to_all(back, send=sizes_of_mine, receive=sizes_to_owners, group=group)
    rows_of, offset = {}, 0
    for q in range(size):
        for i in owned_by[q]:
            rows_of[i] = returned[offset : offset + block[i]].view(per_rank[i], shapes[i][1])
            offset += block[i]
    return [rows_of[i][: item.slot.param.shape[0]] for i, item in enumerate(items)]


def _all_to_all(tensor: torch.Tensor, *, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor``'s ``send[q]`` entries to process q; ``receive[q]`` entries from each, in rank order."""
    output = tensor.new_empty(sum(receive))
    dist.all_to_all_single(output, tensor, output_split_sizes=receive, input_split_sizes=send, group=group)
    return output
