"""Chunked DCT, top-k selection and sparse decoding: the tensor maths of DeMo.

Nothing here talks to other processes. A tensor of any rank is viewed as a matrix
(``rows = shape[0]``, ``cols = product of the other dims``; a 1-D tensor is one row),
cut into ``tile_rows x tile_cols`` tiles, and each tile goes through an orthonormal
DCT-II. A tile side is the largest divisor of its dimension that is not above
``chunk``, so any shape tiles exactly (a prime dimension gets tiles of side 1).

Coefficients live in a *coefficient matrix* shaped like the tensor's matrix view, each
tile's coefficients in place of its entries; :func:`tiles` regroups them one tile per row
for top-k. Indices sent on the wire are positions inside a tile (row-major).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DECODE_MODES = ("selected", "mean")


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is not above ``limit`` (1 for n <= 1)."""
    for d in range(min(n, limit), 1, -1):
        if n % d == 0:
            return d
    return 1


def scaled_topk(topk: int, tile_size: int, chunk: int) -> int:
    """``topk``'s share of a ``chunk x chunk`` tile in a tile of ``tile_size``, to the nearest, at least 1."""
    area = chunk * chunk
    return max(1, min(tile_size, (2 * topk * tile_size + area) // (2 * area)))


def index_dtype_for(tile_size: int) -> torch.dtype:
    """The smallest integer dtype that holds every position in a tile of ``tile_size``."""
    if tile_size <= 2**8:
        return torch.uint8
    if tile_size <= 2**16:
        return torch.uint16
    return torch.int32


def index_bits_for(tile_size: int) -> int:
    """Bits that hold every position in a tile of ``tile_size`` (12 for 64 x 64 tiles)."""
    return max(1, (tile_size - 1).bit_length())


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2**bits`` as a ``uint8`` bit stream, ``bits`` bits each (LSB first)."""
    shifts = torch.arange(bits, device=values.device)
    stream = ((values.reshape(-1, 1).long() >> shifts) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8)).view(-1, 8)
    return (stream << torch.arange(8, device=values.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` int64 values that :func:`pack_bits` wrote into ``packed``."""
    stream = (packed.reshape(-1, 1).long() >> torch.arange(8, device=packed.device)) & 1
    stream = stream.reshape(-1)[: count * bits].view(count, bits)
    return (stream << torch.arange(bits, device=packed.device)).sum(1)


def packed_nbytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


@dataclass(frozen=True)
class EliasFano:
    """Elias-Fano code of ``k`` ascending positions in a tile of ``tile_size``: a fixed size for every tile.

    Each position splits into its ``low_bits`` lowest bits, stored as they are, and the rest, ``high``,
    below ``ceil(tile_size / 2**low_bits)``. The ``i``-th smallest position sets bit ``high + i`` of a
    bit vector of ``k + ceil(tile_size / 2**low_bits)`` bits (the highs in unary). With
    ``low_bits = floor(log2(tile_size / k))`` a position costs at most ``2 + log2(tile_size / k)`` bits:
    9 for 32 of 4,096, where a plain field takes 12. The indices a top-k sends ascend already.
    """

    k: int
    tile_size: int

    @property
    def low_bits(self) -> int:
        return (self.tile_size // self.k).bit_length() - 1

    @property
    def vector_bits(self) -> int:
        """Bits of each tile's unary highs."""
        return self.k + -(-self.tile_size >> self.low_bits)

    @property
    def bits_per_tile(self) -> int:
        return self.k * self.low_bits + self.vector_bits

    def encode(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """``(n_tiles, k)`` positions, ascending in each tile, as two ``uint8`` bit streams: lows, highs."""
        n_tiles, device = indices.shape[0], indices.device
        indices = indices.long()
        ranks = torch.arange(self.k, device=device)
        vector = torch.zeros(n_tiles, self.vector_bits, dtype=torch.int64, device=device)
        vector.scatter_(1, (indices >> self.low_bits) + ranks, 1)
        lows = indices & ((1 << self.low_bits) - 1)
        return [pack_bits(lows, self.low_bits), pack_bits(vector, 1)]

    def decode(self, lows: torch.Tensor, vector: torch.Tensor, n_tiles: int) -> torch.Tensor:
        """The int64 ``(n_tiles, k)`` positions of :meth:`encode`'s streams.

        The ``i``-th set bit of a tile's vector, at ``p``, is high ``p - i``; with ``r`` the set bits up to
        ``p``, ``p - r + 1``. One scatter puts each tile's highs in order (no host sync, no search).
        """
        bits = unpack_bits(vector, 1, n_tiles * self.vector_bits).view(n_tiles, self.vector_bits)
        rank = bits.cumsum(1) - 1
        where = torch.arange(self.vector_bits, device=vector.device) - rank
        # The unset bits all go to a spare column k, dropped afterwards.
        slot = torch.where(bits.bool(), rank, self.k)
        highs = torch.zeros(n_tiles, self.k + 1, dtype=torch.int64, device=vector.device)
        highs.scatter_(1, slot, where)
        low = unpack_bits(lows, self.low_bits, n_tiles * self.k).view(n_tiles, self.k)
        return (highs[:, : self.k] << self.low_bits) | low


VALUE_BITS = (0, 1, 2, 4, 8)
"""Low-bit value formats: 0 sends values as they are; 1 a sign; 2, 4, 8 a symmetric integer code."""


def quantize_tiles(
    values: torch.Tensor, bits: int, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n_tiles, k)`` values as packed ``bits``-bit codes and one float32 scale per tile (:func:`quantize_codes`)."""
    codes, scale = quantize_codes(values, bits, noise)
    return pack_bits(codes, bits), scale


def rounding_noise(
    value_bits: int, rounding: str, shape: tuple[int, ...], device: torch.device, generator=None
) -> torch.Tensor | None:
    """Stochastic rounding's draws for values of ``shape``, uniform in [0, 1) (drawn on the CPU generator, so every
    device draws the same); None when nothing is rounded stochastically."""
    if value_bits and rounding == "stochastic":
        return torch.rand(shape, generator=generator, dtype=torch.float32).to(device)
    return None


def quantize_codes(
    values: torch.Tensor, bits: int, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n_tiles, k)`` values as ``bits``-bit codes (int64, unpacked) and one float32 scale per tile.

    ``bits=1``: the sign of each value, and the tile's mean magnitude as the scale, so a
    value reads back as ``sign * mean|v|`` (the tile's energy on the sent coefficients, with
    each one's direction). ``bits`` of 2, 4 or 8: ``round(v / s)`` with ``s = max|v| / L``,
    ``L = 2**(bits-1) - 1``, clamped to ``[-L, L]``; rounding is to nearest, or with
    ``noise`` (uniform in [0, 1), shaped like ``values``) stochastic: ``floor(v / s + noise)``,
    unbiased in expectation.
    """
    values = values.float()
    if bits == 1:
        scale = values.abs().mean(1)
        codes = (values >= 0).to(torch.int64)
    else:
        levels = 2 ** (bits - 1) - 1
        scale = values.abs().amax(1) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = values / safe.unsqueeze(1)
        rounded = torch.round(scaled) if noise is None else torch.floor(scaled + noise)
        codes = rounded.clamp_(-levels, levels).to(torch.int64) + levels
    return codes, scale


def dequantize_tiles(codes: torch.Tensor, scale: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """The float32 ``(n_tiles, k)`` values that :func:`quantize_tiles` encoded."""
    n_tiles = scale.numel()
    return dequantize_codes(unpack_bits(codes, bits, n_tiles * k).view(n_tiles, k), scale, bits)


def dequantize_codes(raw: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 ``(n_tiles, k)`` values of unpacked codes (:func:`quantize_codes`)."""
    n_tiles = scale.numel()
    levels = 1 if bits == 1 else 2 ** (bits - 1) - 1
    steps = raw * 2 - 1 if bits == 1 else raw - levels
    return steps.float() * scale.float().view(n_tiles, 1)


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Transforms run in float32 at least; 16-bit inputs would lose the small coefficients."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``C`` (``n x n``): coefficients are ``C @ x``, and ``C.T`` inverts it."""
    i = torch.arange(n, dtype=torch.float64)
    c = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c.to(dtype=dtype, device=device)


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor is tiled and compressed."""

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int
    k: int
    """Coefficients kept per tile: ``min(topk, tile_size)``, or with ``scale_topk`` topk's share of a full tile."""

    @classmethod
    def for_shape(cls, shape: Sequence[int], chunk: int, topk: int, scale_topk: bool = False) -> ChunkPlan:
        if len(shape) == 0:
            rows, cols = 1, 1
        elif len(shape) == 1:
            rows, cols = 1, shape[0]
        else:
            rows, cols = shape[0], math.prod(shape[1:])
        tile_rows = largest_divisor_at_most(rows, chunk)
        tile_cols = largest_divisor_at_most(cols, chunk)
        tile_size = tile_rows * tile_cols
        k = min(scaled_topk(topk, tile_size, chunk) if scale_topk else topk, tile_size)
        return cls(rows, cols, tile_rows, tile_cols, k)

    def stacked(self, count: int) -> ChunkPlan:
        """The plan of ``count`` such tensors stacked by rows (a bucket): the same tiles, one tensor's after
        another's, so every per-tile operation on the stack is that operation on each tensor."""
        return dataclasses.replace(self, rows=self.rows * count)

    @property
    def tile_size(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def n_tiles(self) -> int:
        if self.rows == 0 or self.cols == 0:
            return 0
        return (self.rows // self.tile_rows) * (self.cols // self.tile_cols)

    @property
    def index_dtype(self) -> torch.dtype:
        return index_dtype_for(self.tile_size)

    def _grid(self) -> tuple[int, int, int, int]:
        return self.rows // self.tile_rows, self.cols // self.tile_cols, self.tile_rows, self.tile_cols


def _dct_pair(plan: ChunkPlan, dtype: torch.dtype, device: torch.device):
    return dct_matrix(plan.tile_rows, dtype, device), dct_matrix(plan.tile_cols, dtype, device)


def to_coefficients(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """DCT-II of every tile of ``x``, laid out in place: a ``(rows, cols)`` coefficient matrix.

    Coefficient ``(i, j)`` of the tile at block ``(r, c)`` sits at row ``r * tile_rows + i``,
    column ``c * tile_cols + j``. The transform is separable, so it runs as two matrix
    products on contiguous views, with no tile permutation. Computed in float32 or wider.
    """
    dtype = compute_dtype_for(x.dtype)
    left, right = _dct_pair(plan, dtype, x.device)
    y = x.reshape(plan.rows, plan.cols).to(dtype)
    if plan.tile_rows > 1:
        y = torch.matmul(left, y.view(plan.rows // plan.tile_rows, plan.tile_rows, plan.cols))
    if plan.tile_cols > 1:
        y = torch.matmul(y.reshape(plan.rows, plan.cols // plan.tile_cols, plan.tile_cols), right.T)
    return y.reshape(plan.rows, plan.cols)


def from_coefficients(coefficients: torch.Tensor, plan: ChunkPlan, overwrite: bool = False) -> torch.Tensor:
    """Inverse of :func:`to_coefficients`: a ``(rows, cols)`` matrix in the coefficients' dtype.

    ``overwrite``: the result may be written over ``coefficients`` (contiguous, not needed afterwards), so a
    large matrix costs one temporary instead of two.
    """
    left, right = _dct_pair(plan, coefficients.dtype, coefficients.device)
    y = coefficients.reshape(plan.rows, plan.cols)
    if plan.tile_rows > 1:
        y = torch.matmul(left.T, y.reshape(plan.rows // plan.tile_rows, plan.tile_rows, plan.cols))
    if plan.tile_cols > 1:
        shape = (plan.rows, plan.cols // plan.tile_cols, plan.tile_cols)
        reuse = overwrite and plan.tile_rows > 1 and coefficients.is_contiguous()
        out = coefficients.view(shape) if reuse else None
        y = torch.matmul(y.reshape(shape), right, out=out)
    return y.reshape(plan.rows, plan.cols)


def _tile_view(coefficients: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``(grid_r, grid_c, tile_rows, tile_cols)`` view of the coefficient matrix (no copy)."""
    grid_r, grid_c, a, b = plan._grid()
    return coefficients.reshape(grid_r, a, grid_c, b).transpose(1, 2)


def tiles(coefficients: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The coefficient matrix regrouped as ``(n_tiles, tile_size)``, one tile per row (a copy if needed)."""
    return _tile_view(coefficients, plan).reshape(plan.n_tiles, plan.tile_size)


def flat_positions(indices: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Positions in the flattened coefficient matrix of tile-local ``indices`` (``(n_tiles, k)``)."""
    grid_r, grid_c, a, b = plan._grid()
    indices = indices.long()
    tile = torch.arange(plan.n_tiles, device=indices.device).unsqueeze(1)
    row = (tile // grid_c) * a + indices // b
    col = (tile % grid_c) * b + indices % b
    return (row * plan.cols + col).reshape(-1)


def select_topk(coefficients: torch.Tensor, plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``plan.k`` largest-magnitude coefficients of every tile: ``(tile-local int64 indices, values)``.

    Indices ascend within a tile (the fused kernel's order, :mod:`hf_flexdemo.kernels.demo_encode`, so
    both paths put the same value in the same wire slot and draw the same rounding noise for it). Among
    exactly equal magnitudes at the k-th place, ``torch.topk`` picks in its own unspecified order where the
    kernel takes the lowest indices: measure zero for nonzero values.
    """
    magnitudes = torch.empty(plan.n_tiles, plan.tile_size, dtype=coefficients.dtype, device=coefficients.device)
    grid_r, grid_c, a, b = plan._grid()
    # One pass: regroup into tiles and take magnitudes together.
    torch.abs(_tile_view(coefficients, plan), out=magnitudes.view(grid_r, grid_c, a, b))
    indices = magnitudes.topk(plan.k, dim=1, sorted=False)[1].sort(dim=1).values
    values = coefficients.reshape(-1)[flat_positions(indices, plan)].view(indices.shape)
    return indices, values


def decode_replicas(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], plan: ChunkPlan, mode: str, dtype: torch.dtype
) -> torch.Tensor:
    """Average the sparse parts of all replicas into a dense ``(rows, cols)`` coefficient matrix.

    ``mode="selected"`` divides each coefficient by the number of replicas that sent it
    (DeMo's decoding); ``mode="mean"`` divides by the number of replicas. Replicas are
    added in the order given, one at a time, with no atomics: every process that decodes
    the same parts gets bitwise the same result.
    """
    device = parts[0][1].device
    total = torch.zeros(plan.rows * plan.cols, dtype=dtype, device=device)
    positions = []
    for indices, values in parts:
        where = flat_positions(indices, plan)
        # Positions are unique within one replica's part, so each value is added exactly once.
        total[where] += values.reshape(-1).to(dtype)
        positions.append(where)
    if len(parts) == 1:  # each coefficient was picked at most once: both modes divide by one
        return total.view(plan.rows, plan.cols)
    # Only the sent positions are nonzero, so only they are divided (not a pass over the dense matrix).
    # Writing each quotient where several replicas sent it stores the same value twice: deterministic.
    sent = torch.cat(positions)
    if mode == "selected":
        small = torch.uint8 if len(parts) < 256 else torch.int32
        count = torch.zeros(plan.rows * plan.cols, dtype=small, device=device)
        count.index_put_((sent,), torch.ones_like(sent, dtype=count.dtype), accumulate=True)
        divisor = count[sent].to(dtype)
    else:
        divisor = torch.tensor(float(len(parts)), dtype=dtype, device=device)
    total[sent] = total[sent] / divisor
    return total.view(plan.rows, plan.cols)
