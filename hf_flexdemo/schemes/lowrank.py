"""Low-rank factors with error feedback: one side of a rank-``r`` factorization travels, never an index.

PowerSGD's power iteration, one half per replication step, so that each step is one exchange. Every
replica holds the same orthonormal basis ``B`` of one side of each matrix (shared state). A step sends
the momentum's coordinates in that basis, and the average of what arrived is both the update and,
orthonormalized, the next step's basis for the other side::

    side 'right' (B: cols x r)           side 'left' (B: rows x r)
    F     = m @ B                        F     = m^T @ B               rows x r or cols x r, the payload
    m    -= read(F) @ B^T                m    -= B @ read(F)^T         error feedback (read: as received)
    F_avg = mean of every replica's read(F), added in replica order
    U     = F_avg @ B^T                  U     = B @ F_avg^T           the decoded update, rank r at most
    B     = orth(F_avg), on the other side                           the same on every replica
    p    -= lr * rule(U)

Each tensor is a matrix of its first dimension by the rest (a vector: one row); ``r`` is at most its
smaller side. At rank 1 a 2,048 x 2,048 matrix sends 2,048 values a step, not 4 million; ``value_bits``
codes each factor column with one scale. The first basis is a seeded random one (the same on every
replica). The basis and its side are shared state: checkpointed, copied by a healing node, and rebuilt
by replaying the payloads a lagging node missed.
"""

from __future__ import annotations

import math

import torch

from ..buckets import Bucket, ParamSlot
from ..compression import dequantize_codes, dequantize_tiles, pack_bits, quantize_codes, rounding_noise
from ..scheme_traits import SchemeTraits
from .base import Collective, Decoded, StepContext
from .momentum import MomentumScheme

BASIS = "lowrank_basis"
"""Laid out like the parameter; the first ``side_length * r`` entries hold the basis, ``(side_length, r)``."""

LAYOUT = "lowrank_layout"
"""Per process: ``(r, rows, cols)`` the basis was made for (a resume with another rank or shard is refused)."""

SIDE = "lowrank_side"
"""Which side the basis spans: 0 the columns (``m @ B`` travels), 1 the rows (``m^T @ B`` travels)."""

BASIS_SEED = 0x10F7
"""The first basis is drawn from this seed and the parameter's place in the optimizer: alike on every replica."""


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The matrix a tensor of ``shape`` is factored as: its first dimension by the rest; a vector is one row."""
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def orthonormal(factors: torch.Tensor) -> torch.Tensor:
    """``(count, n, r)`` with orthonormal columns spanning ``factors``' (reduced QR; float64 for float64 factors)."""
    dtype = torch.float64 if factors.dtype == torch.float64 else torch.float32
    return torch.linalg.qr(factors.to(dtype), mode="reduced").Q


def seeded_basis(index: int, length: int, r: int) -> torch.Tensor:
    """The first basis of the parameter at ``index`` in the optimizer: ``(length, r)``, alike on every replica."""
    draws = torch.Generator().manual_seed(BASIS_SEED + index)
    return orthonormal(torch.randn(1, length, r, generator=draws))[0]


class LowRankScheme(MomentumScheme):
    name = "lowrank"
    collective = Collective.ALL_GATHER
    traits = SchemeTraits(per_step=True, replayable=True, low_rank=True)
    shared_keys = (BASIS, SIDE)

    def rank(self, bucket: Bucket) -> int:
        return min(self.config.factor_rank, *matrix_shape(bucket.shape))

    def init_state(self, bucket: Bucket) -> None:
        super().init_state(bucket)
        self.side(bucket)
        self.basis_storage(bucket)
        for slot in bucket.slots:
            if LAYOUT not in slot.state.raw:
                slot.state.counters(LAYOUT, 3).copy_(torch.tensor(self.layout(slot.param.shape)))

    def layout(self, shape: torch.Size) -> list[int]:
        rows, cols = matrix_shape(shape)
        return [min(self.config.factor_rank, rows, cols), rows, cols]

    def check_state(self, slot: ParamSlot) -> None:
        saved = slot.state.counters(LAYOUT, 3).tolist()
        if saved != self.layout(slot.param.shape):
            raise RuntimeError(
                f"FlexDeMo: the low-rank basis of a parameter of local shape {tuple(slot.param.shape)} was saved for "
                f"rank {saved[0]} of a {saved[1]} x {saved[2]} shard, but this run gives "
                f"{tuple(self.layout(slot.param.shape))}. Resume with the checkpoint's factor_rank={saved[0]} and "
                "the same number of processes per node (the same FSDP shards)."
            )

    def side(self, bucket: Bucket) -> torch.Tensor:
        """``(count,)`` int64, equal across the bucket (its parameters always step together)."""
        return bucket.scalars(SIDE, torch.int64)

    def basis_storage(self, bucket: Bucket) -> torch.Tensor:
        def first_basis(slot) -> torch.Tensor:
            storage = torch.zeros(bucket.numel, dtype=torch.float32)
            if bucket.numel:
                basis = seeded_basis(slot.index, matrix_shape(bucket.shape)[1], self.rank(bucket))
                storage[: basis.numel()] = basis.reshape(-1)
            return storage.view(bucket.shape).to(bucket.device)

        return bucket.shared(BASIS, torch.float32, first_basis).view(bucket.count, -1)

    def basis(self, bucket: Bucket, side: int) -> torch.Tensor:
        """The current basis, ``(count, side_length, r)``: a view into the shared state."""
        length = matrix_shape(bucket.shape)[1 - side]
        r = self.rank(bucket)
        return self.basis_storage(bucket)[:, : length * r].view(bucket.count, length, r)

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        m = self.accumulate(bucket)
        if not ctx.replicate:
            return []
        if bucket.numel == 0:
            bucket.carried = "empty"  # nothing to send, but the rule still sees the (empty) update
            return []
        side = int(self.side(bucket)[0])
        basis = self.basis(bucket, side).to(m.dtype, copy=True)  # overlap: apply must decode with this one
        matrices = m.view(bucket.count, *matrix_shape(bucket.shape))
        factors = (matrices if side == 0 else matrices.mT) @ basis
        sent, read = self.encode(bucket, factors, ctx)
        if side == 0:
            matrices.sub_(read.to(m.dtype) @ basis.mT)
        else:
            matrices.sub_(basis @ read.to(m.dtype).mT)
        bucket.carried = (side, basis, factors.shape)
        return sent

    def encode(
        self, bucket: Bucket, factors: torch.Tensor, ctx: StepContext
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What travels for ``(count, n, r)`` factors, and the factors every receiver reads back.

        ``value_bits``: each factor column coded with its own scale (:func:`~..compression.quantize_codes`)."""
        bits = self.config.value_bits
        if not bits:
            sent = factors.to(self.wire_dtype(bucket))
            return [sent], sent
        columns = factors.mT.reshape(-1, factors.shape[1])
        noise = rounding_noise(bits, self.config.rounding, columns.shape, columns.device, ctx.noise)
        codes, scale = quantize_codes(columns, bits, noise=noise)
        read = dequantize_codes(codes, scale, bits).view(factors.mT.shape).mT
        return [pack_bits(codes, bits), scale], read

    def read(self, part: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """One replica's ``(count, n, r)`` factors from what it sent."""
        bits = self.config.value_bits
        if not bits:
            return part[0]
        count, n, r = shape
        codes, scale = part
        return dequantize_tiles(codes, scale, bits, n).view(count, r, n).mT

    def apply(self, bucket: Bucket, received: list[list[torch.Tensor]], ctx: StepContext) -> Decoded | None:
        if bucket.carried is None:
            return None
        m = self.momentum(bucket)
        if bucket.carried == "empty":
            return Decoded(bucket, m.new_zeros(0))
        side, basis, shape = bucket.carried
        total = self.read(received[0], shape).to(m.dtype, copy=True)
        for part in received[1:]:  # in replica order, so every replica adds the same numbers the same way
            total += self.read(part, shape).to(m.dtype)
        mean = total / len(received)
        update = mean @ basis.mT if side == 0 else basis @ mean.mT
        # The next basis: the other side, from the average every replica holds alike.
        self.basis(bucket, 1 - side).copy_(orthonormal(mean))
        self.side(bucket).fill_(1 - side)
        return Decoded(bucket, update.reshape(-1))
