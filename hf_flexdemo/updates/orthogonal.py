"""``orthogonal``: replace each matrix's decoded update by its nearest semi-orthogonal matrix.

As Muon does, but on DeMo's decoded update (arXiv 2502.16982; Dion, arXiv 2504.05295, for the
sharded case). For a 2-D parameter with decoded update ``U`` (``rows x cols``)::

    O  = NS(U)                           Newton-Schulz: U's singular values pushed towards 1
    p -= lr * sqrt(max(rows, cols)) * O

The factor makes the step's root mean square about 1 per entry, the size of a sign step, so
a learning rate tuned for ``sign`` is the right order here. Tensors that are not 2-D (norms,
biases, convolution kernels) take the adam rule, as Muon leaves them to AdamW; embeddings and
output heads should too, and the Trainer integration puts them in groups of their own with that
rule (a plain-PyTorch user passes ``elementwise=`` or such a group).

Newton-Schulz runs on a whole bucket at once (a batch of same-shape matrices: ``X @ X.mT`` on
the last two dimensions) in ``ns_dtype``, after normalising each matrix in float32 so that a tiny
update keeps its direction. ``ns_dtype='auto'`` (the default) iterates in bf16, as Muon does, where
the device multiplies bf16 fast, and in float32 elsewhere: on a CPU with AVX2 only, torch multiplies
bf16 matrices one at a time and about 16x slower than float32. The replicas of a matrix must
iterate alike, so the replicas take bf16 only if all their devices would (one all-reduce over the
replicate group, when the optimizer first builds its buckets; under torchft the nodes compare the
dtype they took when they meet, and a node that differs is refused).

Under FSDP2 each process holds a row shard of each matrix. Each matrix has one owner among the
node's processes (a bucket's matrices are dealt out in runs, so the owners share the work evenly):
one all-to-all over the node's own processes (the fast link, never the inter-node one) brings
every owner the row shards of its matrices, the owner orthogonalizes them whole, and a second
all-to-all sends each process its rows back. A node thus runs Newton-Schulz once per matrix,
not once per process, and no process holds more whole matrices than it owns. Every replica
deals the same matrices to the same local ranks and runs the same arithmetic on the same
update, so replicas stay bitwise identical. (The inner step of DiLoCo and SparseLoCo with ``update='orthogonal'``
runs the same way on each replica's own momentum, between outer steps.)
"""

from __future__ import annotations

import functools
import logging
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..buckets import Bucket, ParamSlot
from ..config import NS_DTYPES, FlexDeMoConfig
from ..schemes.base import StepContext
from .adam import AdamRule
from .base import Decoded, UpdateRule

logger = logging.getLogger(__name__)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic of Muon's Newton-Schulz iteration: fast growth of small singular values."""
NS_STEPS = 5
"""Muon's iterations, each with :data:`NS_COEFFICIENTS`."""


def newton_schulz(matrix: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately semi-orthogonal matrices with the singular vectors of ``matrix`` (``(..., rows, cols)``).

    Iterates in ``dtype`` on the last two dimensions, so a stack of matrices is one batched product.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(torch.float32)
    # Singular values into [0, 1], where the iteration converges. The update's scale (lr * grad) can be
    # tiny: its squares would vanish in float32, so the norm sums them in float64, and the guard against a
    # zero matrix is not a fixed epsilon.
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float64).to(torch.float32)
    x = (x / (norm + torch.finfo(torch.float32).tiny)).to(dtype)
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:
        x = x.mT  # iterate on the smaller Gram matrix
    batched = x.unsqueeze(0) if x.dim() == 2 else x.reshape(-1, *x.shape[-2:])
    for step in range(NS_STEPS):
        gram = batched @ batched.mT
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * G + c * G @ G
        if step == NS_STEPS - 1 and not wide:  # the last product transposed: the tall result comes out contiguous
            return torch.baddbmm(batched.mT, batched.mT, polynomial.mT, beta=a).view(matrix.shape)
        batched = torch.baddbmm(batched, polynomial, batched, beta=a)  # a * X + (b * G + c * G @ G) @ X
    return batched.view(x.shape) if wide else batched.view(x.shape).mT


def multiplies_bf16_fast(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices at least about as fast as float32 ones.

    CUDA: compute capability 8.0 or newer (bf16 tensor cores). CPU: bf16 instructions, AVX-512 BF16 or AMX. oneDNN
    also takes bf16 products on AVX-512 without them, but emulates them: a batched product ran 2.4x slower than in
    float32 on such a Xeon (and on AVX2 alone ``bmm`` loops over the batch, about 16x slower).
    """
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":  # private probes: tests/test_library_symbols notices a release that moves them
        probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
        return any(probe is not None and probe() for probe in probes)
    return False


def newton_schulz_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype ``ns_dtype=setting`` iterates in on ``device`` (this process's view; see the module doc)."""
    if setting == "auto":
        return torch.bfloat16 if multiplies_bf16_fast(device) else torch.float32
    return NS_DTYPES[setting]


def agreed_newton_schulz_dtype(
    setting: str, device: torch.device, group: dist.ProcessGroup | None = None
) -> torch.dtype:
    """:func:`newton_schulz_dtype`, the same on every process of ``group`` (the replicate group: the processes
    that compute the same matrices): bf16 only if every one of them takes it. ``group=None``: this process's."""
    dtype = newton_schulz_dtype(setting, device)
    if setting != "auto":
        return dtype
    if group is not None:
        flag = torch.tensor([int(dtype == torch.bfloat16)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        dtype = torch.bfloat16 if flag.item() else torch.float32
    logger.info(
        "FlexDeMo: Newton-Schulz iterates in %s (ns_dtype='auto' on %s; ns_dtype='bf16' or 'float32' chooses).",
        "bf16" if dtype == torch.bfloat16 else "float32",
        device.type,
    )
    return dtype


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
        self.elementwise = AdamRule(config)  # as Muon leaves them to AdamW
        self.state_keys = self.elementwise.state_keys
        self.dtype: torch.dtype | None = None
        """Newton-Schulz's dtype, settled at the first step (``ns_dtype='auto'`` depends on the devices)."""

    def init_state(self, bucket: Bucket) -> None:
        if len(bucket.full_shape) != 2:
            self.elementwise.init_state(bucket)

    def check_state(self, slot: ParamSlot) -> None:
        if slot.state.param.dim() == 2:
            _row_shards(slot.state.param)  # refuse a layout it cannot deal out before anything moves

    @staticmethod
    def is_matrix(item: Decoded) -> bool:
        return len(item.bucket.full_shape) == 2 and item.where is None

    def settle_dtype(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        """Decide Newton-Schulz's dtype once, before the first step's exchange (see the module doc)."""
        if self.dtype is None:
            self.dtype = agreed_newton_schulz_dtype(self.config.ns_dtype, device, group)

    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        assert self.dtype is not None, "settle_dtype() runs when the optimizer builds its buckets"
        matrices = [item for item in decoded if self.is_matrix(item)]
        self.elementwise.apply([item for item in decoded if not self.is_matrix(item)], ctx)
        by_group: dict[object, list[Decoded]] = defaultdict(list)
        for item in matrices:
            shards = _row_shards(item.bucket.slots[0].state.param)
            if shards is None:
                bucket = item.bucket
                whole = item.update.view(bucket.count, *bucket.shape)
                ortho = newton_schulz(whole, dtype=self.dtype)
                self.subtract(item, ortho, scale=step_scale(bucket.full_shape))
            else:
                by_group[shards].append(item)
        for (group, size, rank), items in by_group.items():
            owned = _orthogonalize_by_owner(items, group, size, rank, self.dtype)
            for item, ortho in zip(items, owned):
                self.subtract(item, ortho, scale=step_scale(item.bucket.full_shape))


def step_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """``sqrt(max(rows, cols))``: the factor that makes an orthogonalized ``rows x cols`` step about one per entry.
    The rule folds it into the step's ``lr`` (no pass of its own over the matrix)."""
    return math.sqrt(max(shape[-2:]))


def scaled_newton_schulz(whole: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``step_scale * NS(whole)`` for each ``rows x cols`` matrix: the step per unit of ``lr`` (for benchmarks and
    tests; the rule scales in its subtraction)."""
    return newton_schulz(whole, dtype=dtype).mul_(step_scale(whole.shape))


@functools.lru_cache(maxsize=16)  # the same buckets every step: dealt once per set of shapes
def deal_owners(buckets: tuple[tuple[int, int], ...], size: int) -> tuple[tuple[int, ...], ...]:
    """How many matrices of each bucket (``(count, entries per matrix)``) each of ``size`` processes owns.

    Largest matrices first, each to the least loaded process (ties: lowest rank). A bucket's matrices
    are owned in runs: process 0's first, then process 1's. Depends on the shapes alone, so every
    process and every replica deals alike.
    """
    load = [0] * size
    owned = [[0] * size for _ in buckets]
    for index in sorted(range(len(buckets)), key=lambda i: (-buckets[i][1], i)):
        count, numel = buckets[index]
        for _ in range(count):
            owner = min(range(size), key=lambda rank: (load[rank], rank))
            owned[index][owner] += 1
            load[owner] += numel
    return tuple(tuple(row) for row in owned)


def _orthogonalize_by_owner(
    items: list[Decoded],
    group: dist.ProcessGroup,
    size: int,
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """This process's rows of each bucket's orthogonalizations (unscaled), each matrix computed by its owner.

    FSDP2 splits rows as ``torch.chunk`` does: ``ceil(rows / size)`` per process, the last ones shorter or
    empty. Each shard travels padded to that size, so a process sends every owner the same amount.
    Returns one ``(count, local rows, cols)`` tensor per item.
    """
    shapes = [tuple(item.bucket.full_shape) for item in items]
    counts = [item.bucket.count for item in items]
    per_rank = [math.ceil(rows / size) for rows, _ in shapes]
    block = [per * cols for per, (_, cols) in zip(per_rank, shapes)]  # one padded shard, in entries
    owned = deal_owners(tuple((count, rows * cols) for count, (rows, cols) in zip(counts, shapes)), size)
    first = [[sum(row[:q]) for q in range(size)] for row in owned]  # a bucket's first matrix owned by q
    shards = []
    for item, count, per, (_, cols) in zip(items, counts, per_rank, shapes):
        local = item.update.view(count, item.bucket.shape[0], cols).to(torch.float32)
        shards.append(torch.nn.functional.pad(local, (0, 0, 0, per - local.shape[1])))
    buckets = range(len(items))
    # Out: to each owner q, this process's shards of the matrices q owns, bucket by bucket.
    sent = torch.cat(
        [shards[j][first[j][q] : first[j][q] + owned[j][q]].reshape(-1) for q in range(size) for j in buckets]
    )
    sizes_to_owners = [sum(owned[j][q] * block[j] for j in buckets) for q in range(size)]
    sizes_of_mine = [sum(owned[j][rank] * block[j] for j in buckets)] * size
    received = _all_to_all(sent, send=sizes_to_owners, receive=sizes_of_mine, group=group).view(size, -1)
    # Every source sent its shards of my matrices in the same order, source q's rows q-th.
    results, start = [], 0
    for j in buckets:
        mine, (rows, cols), per = owned[j][rank], shapes[j], per_rank[j]
        if mine == 0:
            continue
        stacked = received[:, start : start + mine * block[j]].reshape(size, mine, per, cols)
        whole = stacked.transpose(0, 1).reshape(mine, size * per, cols)[:, :rows]
        ortho = torch.nn.functional.pad(newton_schulz(whole, dtype=dtype), (0, 0, 0, size * per - rows))
        results.append(ortho.view(mine, size, per, cols).transpose(0, 1).reshape(size, mine * block[j]))
        start += mine * block[j]
    # Back: to each process q, its rows of every matrix this process owns, in the same order.
    back = torch.cat(results, dim=1).reshape(-1) if results else sent.new_empty(0).to(dtype)
    returned = _all_to_all(back, send=sizes_of_mine, receive=sizes_to_owners, group=group)
    pieces = returned.split([owned[j][q] * block[j] for q in range(size) for j in buckets])
    rows_back = []
    for j, item in enumerate(items):
        (_, cols), per = shapes[j], per_rank[j]
        owners = [pieces[q * len(items) + j].view(owned[j][q], per, cols) for q in range(size)]
        local_rows = item.bucket.shape[0]
        rows_back.append(torch.cat(owners)[:, :local_rows])
    return rows_back


def _all_to_all(tensor: torch.Tensor, *, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor``'s ``send[q]`` entries to process q; ``receive[q]`` entries from each, in rank order."""
    output = tensor.new_empty(sum(receive))
    dist.all_to_all_single(output, tensor, output_split_sizes=receive, input_split_sizes=send, group=group)
    return output
