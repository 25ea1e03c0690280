"""DeMo over an index set the replicas share: an all-reduce whose bytes per node stay flat in R.

DeMo's all-gather sends each node's top-k to every other node, ``(R - 1) * P`` bytes per
node and step. Here every replica sends its coefficients at the *same* positions, so the
values can be summed in a ring all-reduce: about ``2 * P`` per node, whatever ``R``.

Per replication step and parameter (``shared_indices=True``)::

    I     = this step's index set         k positions per tile, the same on every replica
    q     = Q[I]                          this replica's coefficients there
    Q[I]  = 0                             error feedback: what was sent leaves the momentum
    J     = top-k of |Q| per tile         on the leader only: replica (replication % R)
    mean  = all-reduce(q, J or zeros)     one collective; J travels summed with zeros
    p    -= lr * sign(IDCT(mean at I))
    I     = J                             the next step's set

The leader picks the next step's set from its own momentum after error feedback, so
every replica's large coefficients are picked at least once every ``R`` replications and
wait in the momentum until then (decaying with it, as DeMo's unsent coefficients do). Values
and indices travel as float32 numbers (float64 for float64 momentum): a sum of one index and
zeros is exact there (tiles of up to 2**22 positions), and an all-reduce cannot sum low-bit
codes with per-tile scales, so ``value_bits``, ``pack_indices`` and 16-bit ``value_dtype`` do
not apply. The first step uses each tile's first ``k`` positions (its lowest frequencies).

The index set is shared state, kept as a 0/1 mask laid out like the parameter (one byte per
entry): checkpointed with the model's layout, copied by a healing node.
One replica: it is its own leader every step.
"""

from __future__ import annotations

import torch

from ..buckets import Bucket, ParamSlot
from ..compression import ChunkPlan, decode_replicas, flat_positions, from_coefficients, select_topk, tiles
from .base import Collective, Decoded, StepContext
from .demo import DeMoScheme

EXACT_POSITIONS = 2**22
"""Tile positions that survive the all-reduce's division by R and the multiplication back exactly in float32."""

INDEX_SET = "shared_index_mask"
"""Laid out like the parameter's coefficients: 1 at the ``k`` positions per tile every replica sends next."""


class SharedIndexDeMoScheme(DeMoScheme):
    collective = Collective.ALL_REDUCE
    shared_keys = (INDEX_SET,)

    def init_state(self, bucket: Bucket) -> None:
        super().init_state(bucket)
        self.mask(bucket)

    def check_state(self, slot: ParamSlot) -> None:
        super().check_state(slot)
        plan = self.tensor_plan(slot.param.shape, slot.group)
        if plan.n_tiles == 0:
            return
        if plan.tile_size > EXACT_POSITIONS:
            raise ValueError(
                f"FlexDeMo: chunk={slot.group['chunk']} gives tiles of {plan.tile_size} positions for a parameter of "
                f"local shape {tuple(slot.param.shape)}; with shared_indices=True a position must stay exact through "
                f"the float32 all-reduce, so tiles hold at most {EXACT_POSITIONS}. Use chunk <= 2048 (default 64)."
            )
        mask = slot.state.read(INDEX_SET).view(plan.rows, plan.cols)
        per_tile = tiles(mask, plan).sum(1)
        if not bool((per_tile == plan.k).all()):
            raise RuntimeError(
                f"FlexDeMo: the shared index set of a parameter of local shape {tuple(slot.param.shape)} holds "
                f"{int(per_tile.max())} positions per tile, but this run sends {plan.k} (topk={slot.group['topk']}, "
                f"scale_topk={self.config.scale_topk}). Resume with the topk, chunk and scale_topk the checkpoint was "
                "saved with."
            )

    def mask(self, bucket: Bucket) -> torch.Tensor:
        """The index set as a ``(rows, cols)`` 0/1 mask of the stack; each tile's first ``k`` positions at first."""

        def first_positions(slot: ParamSlot) -> torch.Tensor:
            plan = self.tensor_plan(bucket.shape, bucket.group)
            mask = torch.zeros(plan.rows * plan.cols, dtype=torch.uint8, device=bucket.device)
            first = torch.arange(plan.k, device=mask.device).repeat(plan.n_tiles, 1)
            mask[flat_positions(first, plan)] = 1
            return mask.view(bucket.shape)

        plan = self.plan(bucket)
        return bucket.shared(INDEX_SET, torch.uint8, first_positions).view(plan.rows, plan.cols)

    def index_set(self, bucket: Bucket, plan: ChunkPlan) -> torch.Tensor:
        """``(n_tiles, k)`` tile-local positions, ascending: every replica reads them in the same order."""
        # A stable sort keeps the ones in position order, with a fixed shape (nonzero() would sync the host).
        order = torch.sort(tiles(self.mask(bucket), plan), dim=1, descending=True, stable=True).indices
        return order[:, : plan.k]

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        q = self.accumulate(bucket)
        plan = self.plan(bucket)
        if not ctx.replicate:
            return []
        if plan.n_tiles == 0:
            bucket.carried = (plan, None)
            return []
        index_set = self.index_set(bucket, plan)
        where = flat_positions(index_set, plan)
        flat = q.view(-1)
        wire = torch.promote_types(q.dtype, torch.float32)
        values = flat[where].to(wire)
        flat.index_fill_(0, where, 0.0)  # all of it is sent: nothing of these coefficients stays
        following = torch.zeros(plan.n_tiles * plan.k, dtype=wire, device=q.device)
        if self.leader(ctx) == ctx.rank:
            following.copy_(select_topk(q, plan)[0].reshape(-1))
        bucket.carried = (plan, index_set)
        return [values, following]

    def leader(self, ctx: StepContext) -> int:
        """The replica that picks the next step's index set: each in turn."""
        return (ctx.step // self.config.replicate_every) % ctx.replicas

    def apply(self, bucket: Bucket, received: list[torch.Tensor], ctx: StepContext) -> Decoded | None:
        if bucket.carried is None:
            return None
        plan, index_set = bucket.carried
        if plan.n_tiles == 0:
            return self.empty_update(bucket)
        mean, following = received
        dtype = self.momentum(bucket).dtype
        parts = [(index_set, mean.view(plan.n_tiles, plan.k))]
        coefficients = decode_replicas(parts, plan, "mean", dtype)
        # The leader's indices arrive divided by R (summed with zeros, then averaged): exact after rounding.
        following = following.mul(ctx.replicas).round_().long().view(plan.n_tiles, plan.k)
        mask = self.mask(bucket).view(-1)
        mask.zero_()
        mask[flat_positions(following, plan)] = 1
        return Decoded(bucket, from_coefficients(coefficients, plan, overwrite=True).view(-1))
