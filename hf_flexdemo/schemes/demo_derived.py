"""DeMo with positions every replica derives alike: values travel without indices.

A top-k selection pays about ``log2(tile / k)`` bits per index, more than a 1- or 2-bit
value. Here most of each tile's coefficients go at positions no replica has to name: the
``derived_topk`` positions where the decoded updates (identical on every replica) have been
largest lately. A small per-replica top-k (``topk``, with its indices, as DeMo sends it) beside
them catches what the derived set misses, and feeds the score that picks the next set.

Per replication step and parameter (``derived_topk=D``, ``topk=k``)::

    P     = top-D of the score S per tile    ties to the lower position; the same on every replica
    w     = S[P] / max per tile              each value's expected magnitude, known to every replica
    Q[P] -= decoded(Q[P])                    values only: at 1 bit sign(Q[P]) * a * w, with a tile's fit
                                             a = sum |Q[P]| w / sum w^2; else value_bits codes and a scale,
                                             or value_dtype
    J     = top-k of |Q| outside P           DeMo's selection, with its indices
    Q[J] -= decoded(Q[J])                    error feedback, as DeMo's
    U     = mean of all replicas' Q[P] at P, decode(J parts) elsewhere
    S     = SCORE_DECAY * S + |U|            replica-identical: every replica decodes the same U
    p    -= lr * rule(IDCT(U))

At the first step the score prefers each tile's lowest frequencies. The score is shared state
(laid out like the parameter, float32): checkpointed with it, copied by a healing node, and
rebuilt by replaying the payloads a lagging node missed.
"""

from __future__ import annotations

import torch

from ..buckets import Bucket
from ..compression import (
    ChunkPlan,
    decode_replicas,
    dequantize_codes,
    dequantize_tiles,
    flat_positions,
    from_coefficients,
    pack_bits,
    quantize_codes,
    select_topk,
    tiles,
    unpack_bits,
)
from .base import Decoded, StepContext
from .demo import DeMoScheme, tile_plan

SCORE = "derived_score"
"""Laid out like the parameter's coefficients: a decaying sum of the decoded updates' magnitudes."""

NO_HISTORY = 1e-20
"""A tile whose score stays below this has no decoded update yet (the first step's preference is about 1e-27)."""

SCORE_DECAY = 0.9
"""How fast a position that stops arriving leaves the derived set (about ten replications)."""


class DerivedIndexDeMoScheme(DeMoScheme):
    shared_keys = (SCORE,)

    def init_state(self, bucket: Bucket) -> None:
        super().init_state(bucket)
        self.score(bucket)

    def derived_plan(self, bucket: Bucket) -> ChunkPlan:
        """The derived set's tiling: DeMo's tiles, ``derived_topk`` positions each (at most the tile)."""
        return tile_plan(bucket.shape, bucket.group, self.config, self.config.derived_topk).stacked(bucket.count)

    def score(self, bucket: Bucket) -> torch.Tensor:
        """The ``(rows, cols)`` score of the stack; at first a ramp that prefers each tile's lowest frequencies."""

        def lowest_first(slot) -> torch.Tensor:
            plan = self.tensor_plan(bucket.shape, bucket.group)
            ramp = torch.arange(plan.tile_size, 0, -1, dtype=torch.float32, device=bucket.device) * 1e-30
            score = torch.empty(plan.rows * plan.cols, dtype=torch.float32, device=bucket.device)
            score[flat_positions(torch.arange(plan.tile_size, device=bucket.device).repeat(plan.n_tiles, 1), plan)] = (
                ramp.repeat(plan.n_tiles)
            )
            return score.view(bucket.shape)

        plan = self.plan(bucket)
        return bucket.shared(SCORE, torch.float32, lowest_first).view(plan.rows, plan.cols)

    def derived_set(self, bucket: Bucket, plan: ChunkPlan) -> torch.Tensor:
        """``(n_tiles, D)`` tile-local positions, ascending; equal scores go to the lower position."""
        order = torch.sort(tiles(self.score(bucket), plan), dim=1, descending=True, stable=True).indices
        return order[:, : plan.k].sort(dim=1).values

    def expected_magnitudes(self, bucket: Bucket, at: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``(n_tiles, D)`` weights from the score at the derived positions, each tile's largest 1: how large each
        value is expected to be, known alike to every replica (a tile with no history yet: all 1)."""
        weights = self.score(bucket).view(-1)[at].view(shape)
        largest = weights.amax(dim=1, keepdim=True)
        fresh = largest < NO_HISTORY
        return torch.where(fresh, torch.ones_like(weights), weights / torch.where(fresh, 1.0, largest))

    def encode_values(self, values: torch.Tensor, weights: torch.Tensor, wire_dtype: torch.dtype, ctx: StepContext):
        """What travels for the derived set's ``(n_tiles, D)`` values, and the values receivers read back.

        At 1 bit a value reads back as its sign times ``scale * weight``: the magnitudes come from the shared
        score, and the tile's scale is their least-squares fit to ``|v|``."""
        bits = self.config.value_bits
        if bits == 1:
            values = values.float()
            scale = (values.abs() * weights).sum(1) / (weights * weights).sum(1)
            codes = (values >= 0).to(torch.int64)
            return [pack_bits(codes, 1), scale], self.signed(codes, scale, weights)
        if bits:
            codes, scale = quantize_codes(values, bits, self.wire.noise(values.shape, values.device, ctx.noise))
            return [pack_bits(codes, bits), scale], dequantize_codes(codes, scale, bits)
        sent = values.to(wire_dtype)
        return [sent], sent

    @staticmethod
    def signed(codes: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (codes * 2 - 1).float() * weights * scale.view(-1, 1)

    def read_values(self, part: list[torch.Tensor], plan: ChunkPlan, weights: torch.Tensor) -> torch.Tensor:
        if self.config.value_bits == 1:
            codes, scale = part
            return self.signed(unpack_bits(codes, 1, weights.numel()).view(weights.shape), scale, weights)
        if self.config.value_bits:
            codes, scale = part
            return dequantize_tiles(codes, scale, self.config.value_bits, plan.k)
        return part[0]

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        q = self.accumulate(bucket)
        plan = self.plan(bucket)
        if not ctx.replicate:
            return []
        bucket.carried = (plan, None, None)
        if plan.n_tiles == 0:
            return []
        derived_plan = self.derived_plan(bucket)
        derived = self.derived_set(bucket, derived_plan)
        wire_dtype = self.wire_dtype(bucket)
        flat = q.view(-1)
        at = flat_positions(derived, derived_plan)
        weights = self.expected_magnitudes(bucket, at, derived.shape)
        derived_sent, derived_read = self.encode_values(flat[at].view(derived.shape), weights, wire_dtype, ctx)
        flat.index_add_(0, at, derived_read.reshape(-1).to(q.dtype), alpha=-1.0)
        # The top-k looks only where the derived set did not: their residuals leave Q while it picks (no copy of Q).
        residuals = flat[at]
        flat[at] = 0.0
        indices, values = select_topk(q, plan)
        flat[at] = residuals
        sent, read = self.wire.encode(indices, values, plan, wire_dtype, generator=ctx.noise)
        flat.index_add_(0, flat_positions(indices, plan), read.reshape(-1).to(q.dtype), alpha=-1.0)
        bucket.carried = (plan, derived, weights)
        return [*derived_sent, *sent]

    def apply(self, bucket: Bucket, received: list[list[torch.Tensor]], ctx: StepContext) -> Decoded | None:
        if bucket.carried is None:
            return None
        plan, derived, weights = bucket.carried
        if plan.n_tiles == 0:
            return self.empty_update(bucket)
        derived_plan = self.derived_plan(bucket)
        dtype = self.momentum(bucket).dtype
        split = 2 if self.config.value_bits else 1
        # Every replica sent the whole derived set: its mean is a plain mean, added in replica order.
        total = sum(self.read_values(part[:split], derived_plan, weights).to(dtype) for part in received)
        update = decode_replicas([(derived, total / len(received))], derived_plan, "mean", dtype).view(-1)
        parts = [self.wire.read(part[split:], plan) for part in received]
        update += decode_replicas(parts, plan, self.config.decode, dtype).view(-1)
        self.score(bucket).view(-1).mul_(SCORE_DECAY).add_(update.abs())
        coefficients = update.view(plan.rows, plan.cols)
        return Decoded(bucket, from_coefficients(coefficients, plan, overwrite=True).view(-1))
