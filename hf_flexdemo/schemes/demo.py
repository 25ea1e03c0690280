"""DeMo: send the top-k DCT coefficients of each momentum tile, apply the sign of their average.

Per replication step and parameter::

    Q     = DCT(m)                       chunked, orthonormal DCT-II
    q     = top-k of Q per tile          the fast-moving components
    m    -= IDCT(q)                      error feedback: what was sent leaves the momentum
    Q_avg = decode(q from all replicas)  mean over the replicas that picked a coefficient
    p    -= lr * sign(IDCT(Q_avg))      the group's update rule (hf_flexdemo.updates)

The DCT is linear and orthonormal, so the momentum is kept as its coefficients ``Q``:
``Q = decay * Q + lr * DCT(grad)``, and error feedback is ``Q -= q``. That is the same
rule with one transform fewer per step (two instead of three). The state entry
``momentum_dct`` holds ``Q`` laid out like the parameter (see :mod:`..compression`); a bucket's
tensors are stacked by rows, so each phase is one operation on all of them.

With ``kernels='triton'`` the momentum update, the top-k, the wire's quantization and the error feedback run as
one fused pass per tile (:mod:`hf_flexdemo.kernels.demo_encode`), and the received parts go to the rule as they
are (:class:`~.base.SparseCoefficients`): the sign rule applies them fused, the others make them dense.

One replica: no communication; the update is the sign of the replica's own top-k
reconstruction (the momentum and error feedback still work as above).
"""

from __future__ import annotations

import torch

from ..buckets import Bucket, ParamSlot
from ..compression import ChunkPlan, to_coefficients
from ..config import DEFAULT_WIRE, OLD_DEFAULT_WIRE, FlexDeMoConfig
from ..kernels import check_bucket, encoder
from ..scheme_traits import SchemeTraits
from .base import Collective, Decoded, SparseCoefficients, StepContext
from .momentum import MomentumScheme
from .sparse_wire import TopKWire

TILE_STATE = "dct_tiles"
"""Per-rank (tile_rows, tile_cols) the coefficients were computed with."""


def check_saved_tiles(saved_groups: list[dict], param_groups: list[dict], wire: str | None) -> None:
    """torch's ``load_state_dict`` restores the saved groups' ``chunk`` and ``topk``: a run resumed with others (another
    ``wire=`` preset) would train on the checkpoint's without a word, so it is refused, naming both."""
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        was = {key: saved[key] for key in ("chunk", "topk") if key in saved}
        now = {key: group[key] for key in was}
        if was != now:
            written = ", ".join(f"{key}={value}" for key, value in was.items())
            asked = ", ".join(f"{key}={value}" for key, value in now.items())
            preset = f" (wire={wire!r})" if wire else ""
            if wire == DEFAULT_WIRE:  # a plain torch resume of a run from before the default moved
                before = f"; a run that named no wire before the default became {DEFAULT_WIRE!r}"
                preset += f"{before} sent wire={OLD_DEFAULT_WIRE!r}"
            raise ValueError(
                f"FlexDeMo: the checkpoint trained parameter group {index} with {written}, but this run sets "
                f"{asked}{preset}; torch would restore the checkpoint's and train on them without a word. Resume "
                f"with the wire= preset or the {' and '.join(was)} the checkpoint was trained with, or start a new "
                "run in another output_dir."
            )


def tile_plan(shape: torch.Size, group: dict, config: FlexDeMoConfig, topk: int | None = None) -> ChunkPlan:
    """How one tensor of local ``shape`` is tiled under ``group``'s chunk, keeping ``topk`` (the group's if unset)."""
    topk = group["topk"] if topk is None else topk
    return ChunkPlan.for_shape(shape, group["chunk"], topk, config.scale_topk)


class DeMoScheme(MomentumScheme):
    name = "demo"
    collective = Collective.ALL_GATHER
    traits = SchemeTraits(per_step=True, replayable=True, top_k=True, dct=True, fused_kernels=True, payload_first=True)
    momentum_key = "momentum_dct"

    def __init__(self, config: FlexDeMoConfig):
        super().__init__(config)
        self.wire = TopKWire(config)

    def init_state(self, bucket: Bucket) -> None:
        if self.config.kernels == "triton":  # the parameters' device is known now, before anything moves
            check_bucket(bucket.device, bucket.dtype, bucket.group["chunk"])
        super().init_state(bucket)
        for slot in bucket.slots:
            if TILE_STATE not in slot.state.raw:
                plan = self.tensor_plan(slot.param.shape, bucket.group)
                tiles = slot.state.counters(TILE_STATE, 2)
                tiles.copy_(torch.tensor([plan.tile_rows, plan.tile_cols]))

    def check_state(self, slot: ParamSlot) -> None:
        plan = self.tensor_plan(slot.param.shape, slot.group)
        tiles = slot.state.counters(TILE_STATE, 2)
        if tiles.tolist() != [plan.tile_rows, plan.tile_cols]:
            raise RuntimeError(
                f"FlexDeMo: the momentum of a parameter of local shape {tuple(slot.param.shape)} was saved with "
                f"DCT tiles {tuple(tiles.tolist())}, but this layout gives {(plan.tile_rows, plan.tile_cols)}. "
                "Resume with the same number of processes per node (the same FSDP shards) as the checkpoint."
            )

    def tensor_plan(self, shape: torch.Size, group: dict) -> ChunkPlan:
        """How one tensor of local ``shape`` is tiled."""
        return tile_plan(shape, group, self.config)

    def plan(self, bucket: Bucket) -> ChunkPlan:
        """The bucket's tensors stacked by rows: each keeps its own tiles."""
        return self.tensor_plan(bucket.shape, bucket.group).stacked(bucket.count)

    def accumulate(self, bucket: Bucket) -> torch.Tensor:
        """``Q = decay * Q + lr * DCT(grad)``; returns ``Q`` as a ``(rows, cols)`` view of the stack."""
        plan = self.plan(bucket)
        q = self.momentum(bucket).view(plan.rows, plan.cols)
        if plan.n_tiles:
            q.mul_(bucket.group["decay"]).add_(to_coefficients(bucket.grad, plan), alpha=bucket.group["lr"])
        return q

    def local_step(self, bucket: Bucket, ctx: StepContext) -> list[torch.Tensor]:
        plan = self.plan(bucket)
        if ctx.replicate:
            bucket.carried = plan  # empty shards send nothing, but their (empty) update still reaches the rule
        if plan.n_tiles == 0:
            return []
        # Q = decay * Q + lr * DCT(grad); on a replication step also the top-k per tile, encoded for the wire, and
        # error feedback: what travels (as the receivers will decode it) leaves Q, so the rounding error stays.
        wire_dtype = self.wire_dtype(bucket)
        encoded = encoder(self.config.kernels)(
            bucket.grads if self.config.kernels == "triton" else bucket.grad,  # the kernel reads them unstacked
            self.momentum(bucket),
            plan,
            decay=bucket.group["decay"],
            lr=bucket.group["lr"],
            select=ctx.replicate,
            bits=self.config.value_bits,
            wire_dtype=wire_dtype,
            noise=self.wire.noise((plan.n_tiles, plan.k), bucket.device, ctx.noise) if ctx.replicate else None,
        )
        return self.wire.pack(*encoded, plan, wire_dtype) if encoded is not None else []

    def empty_update(self, bucket: Bucket) -> Decoded:
        """Empty shards' update: the rule still sees it, since orthogonal moves a node's shards to their owners."""
        return Decoded(bucket, self.momentum(bucket).new_zeros(bucket.count * bucket.numel))

    def apply(self, bucket: Bucket, received: list[list[torch.Tensor]], ctx: StepContext) -> Decoded | None:
        plan = bucket.carried
        if plan is None:
            return None
        if plan.n_tiles == 0:
            return self.empty_update(bucket)
        parts = [self.wire.read(part, plan) for part in received]
        sparse = SparseCoefficients(plan, parts, "selected", self.momentum(bucket).dtype, self.config.kernels)
        if self.config.kernels == "triton":  # the sign rule applies it as it is; the others ask for it dense
            return Decoded(bucket, sparse=sparse)
        return Decoded(bucket, sparse.dense())
