"""DeMo's encode pass over a bucket as torch operations: the path ``kernels='torch'`` runs, and the function that
:func:`hf_flexdemo.kernels.demo_encode.demo_encode` must equal.

Per bucket (its tensors stacked by rows, :meth:`hf_flexdemo.compression.ChunkPlan.stacked`)::

    Q  = decay * Q + lr * DCT(grad)          per tile, orthonormal DCT-II
    S  = the k largest |Q| of each tile      tile-local indices, ascending
    v  = Q[S]                                what is sent: as it is (cast to the wire dtype), or quantized
    Q[S] -= decoded(v)                       error feedback: what the receivers will read leaves Q
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..compression import ChunkPlan, dequantize_codes, flat_positions, quantize_codes, select_topk, to_coefficients


class EncodedTiles(NamedTuple):
    """One bucket's selection: each ``(n_tiles, k)`` except ``scale`` (``(n_tiles,)``)."""

    indices: torch.Tensor
    """Tile-local positions (row-major), ascending within a tile."""
    values: torch.Tensor
    """The selected coefficients, float32, before error feedback (the wire casts them to its dtype)."""
    codes: torch.Tensor | None
    """``value_bits`` > 0: each value's code, unpacked (:func:`hf_flexdemo.compression.quantize_codes`)."""
    scale: torch.Tensor | None
    """``value_bits`` > 0: one float32 scale per tile."""


def demo_encode_torch(
    grad: torch.Tensor | Sequence[torch.Tensor],
    q: torch.Tensor,
    plan: ChunkPlan,
    *,
    decay: float,
    lr: float,
    select: bool,
    bits: int,
    wire_dtype: torch.dtype,
    noise: torch.Tensor | None = None,
) -> EncodedTiles | None:
    """Fold ``grad`` into the momentum coefficients ``q`` (``plan.rows x plan.cols``, in place); with ``select``,
    pick, encode and subtract each tile's top-k. ``noise``: stochastic rounding's draws, ``(n_tiles, k)``.
    ``grad``: the bucket's gradients stacked, or one tensor per parameter (stacked here)."""
    if not isinstance(grad, torch.Tensor):
        grad = torch.stack(list(grad))
    q = q.view(plan.rows, plan.cols)
    if plan.n_tiles == 0:
        return None
    q.mul_(decay).add_(to_coefficients(grad, plan), alpha=lr)
    if not select:
        return None
    indices, values = select_topk(q, plan)
    codes = scale = None
    if bits:
        codes, scale = quantize_codes(values, bits, noise)
        decoded = dequantize_codes(codes, scale, bits)
    else:
        decoded = values.to(wire_dtype)
    q.view(-1).index_add_(0, flat_positions(indices, plan), decoded.reshape(-1).to(q.dtype), alpha=-1.0)
    return EncodedTiles(indices, values, codes, scale)
