"""DeMo's encode pass as one Triton program per tile: it must equal :func:`.demo_encode_torch.demo_encode_torch`.

A program loads one tile of a parameter's gradient (16- or 32-bit, read as float32; each parameter's through a
table of their addresses, so they are not stacked first) and of the momentum coefficients ``Q`` (float32, the
bucket's stack), and in registers::

    Q  = decay * Q + lr * (L @ G @ R^T)      L, R: the tile's DCT-II matrices, zero-padded (exact on real entries)
    T  = the k-th largest |Q|                bisection on the bit pattern of |Q| (monotone for non-negative floats)
    S  = {|Q| > T}, then the entries |Q| == T of lowest index until there are k
    idx, v = S's tile-local indices (ascending, compacted by a cumulative sum) and Q there
    codes, scale = quantize(v)               value_bits 1, 2, 4, 8, as hf_flexdemo.compression.quantize_codes
    Q[S] -= decoded(v)                       error feedback: with value_bits=0 and float32 on the wire, Q[S] = 0

then stores ``Q`` and the ``(n_tiles, k)`` selection: the momentum is read and written once, the gradient read
once. Tile sides are padded to a power of two of at least 16 (``tl.arange``, ``tl.dot``), with masked loads.
Products take :func:`._triton_common.dot_precision`: three TF32 products on GPUs that have TF32, IEEE float32
elsewhere (one TF32 product would differ from the torch path by more than float32 rounding).

Versus the torch path: the same maths in float32 with other summation orders (the DCT's products, the 1-bit
scale's mean), so ``Q`` agrees to float32 rounding and the selection is the same wherever the k-th and the
(k+1)-th magnitudes are further apart than that. Exact ties at the k-th magnitude go to the lowest indices here;
``torch.topk`` picks among them in its own order. The kernel runs in a fixed order with no atomics, so every
replica computes bitwise the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..compression import ChunkPlan
from . import padded_dct
from ._triton_common import (
    address_table,
    dot_precision,
    dtype_code,
    largest,
    round_half_even,
    round_to_dtype,
    running_total,
    total,
)
from .demo_encode_torch import EncodedTiles


@triton.jit
def _demo_encode_kernel(
    grad_table_ptr,
    q_ptr,
    left_ptr,
    right_ptr,
    noise_ptr,
    index_ptr,
    value_ptr,
    code_ptr,
    scale_ptr,
    cols,
    grid_cols,
    tiles_per_grad,
    decay,
    lr,
    GRAD: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
    A: tl.constexpr,
    B: tl.constexpr,
    K: tl.constexpr,
    SELECT: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    WIRE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    base = (tile // grid_cols).to(tl.int64) * TILE_ROWS * cols + (tile % grid_cols) * TILE_COLS
    i = tl.arange(0, A)[:, None]
    j = tl.arange(0, B)[None, :]
    inside = (i < TILE_ROWS) & (j < TILE_COLS)
    offsets = base + i * cols + j
    local = tile % tiles_per_grad  # the tile within its gradient
    grad_offsets = (local // grid_cols).to(tl.int64) * TILE_ROWS * cols + (local % grid_cols) * TILE_COLS + i * cols + j
    address = tl.load(grad_table_ptr + tile // tiles_per_grad)
    if GRAD == 1:
        grad_ptr = address.to(tl.pointer_type(tl.bfloat16))
    elif GRAD == 2:
        grad_ptr = address.to(tl.pointer_type(tl.float16))
    else:
        grad_ptr = address.to(tl.pointer_type(tl.float32))
    g = tl.load(grad_ptr + grad_offsets, mask=inside, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + offsets, mask=inside, other=0.0)
    left = tl.load(left_ptr + i * A + tl.arange(0, A)[None, :])  # L[i, m]
    right_t = tl.load(right_ptr + j * B + tl.arange(0, B)[:, None])  # R^T[n, j] = R[j, n]
    coefficients = tl.dot(tl.dot(left, g, input_precision=PRECISION), right_t, input_precision=PRECISION)
    q = decay * q + lr * coefficients
    if not SELECT:
        tl.store(q_ptr + offsets, q, mask=inside)
        return

    # The tile flattened row-major: position p = i * B + j ascends with the tile-local index i * TILE_COLS + j.
    flat_q = tl.reshape(q, (A * B,))
    flat_inside = tl.reshape(inside, (A * B,))
    flat_index = tl.reshape(i * TILE_COLS + j, (A * B,))
    flat_offsets = tl.reshape(offsets, (A * B,))
    magnitude = tl.where(flat_inside, flat_q.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)

    # The k-th largest magnitude: the largest bit pattern T with at least K entries >= T.
    low = tl.full((), 0, tl.int32)
    high = tl.full((), 0x7FFFFFFF, tl.int32)
    for _ in range(31):
        span = high - low
        middle = low + (span >> 1) + (span & 1)
        enough = total((magnitude >= middle).to(tl.int32), axis=0) >= K
        low = tl.where(enough, middle, low)
        high = tl.where(enough, high, middle - 1)
    above = magnitude > low
    at = magnitude == low
    missing = K - total(above.to(tl.int32), axis=0)
    chosen = above | (at & (running_total(at.to(tl.int32), axis=0) <= missing))
    out = tile.to(tl.int64) * K + running_total(chosen.to(tl.int32), axis=0) - 1
    tl.store(index_ptr + out, flat_index, mask=chosen)
    tl.store(value_ptr + out, flat_q, mask=chosen)

    if BITS == 0:
        decoded = round_to_dtype(flat_q, WIRE)
    else:
        sent = tl.where(chosen, tl.abs(flat_q), 0.0)
        if BITS == 1:
            scale = tl.div_rn(total(sent, axis=0), tl.full((), K, tl.float32))
            code = (flat_q >= 0).to(tl.int32)
            decoded = tl.where(flat_q >= 0, scale, -scale)
        else:
            scale = tl.div_rn(largest(sent, axis=0), tl.full((), LEVELS, tl.float32))
            safe = tl.where(scale > 0, scale, 1.0)
            scaled = tl.div_rn(flat_q, safe)
            if STOCHASTIC:
                rounded = tl.floor(scaled + tl.load(noise_ptr + out, mask=chosen, other=0.0))
            else:
                rounded = round_half_even(scaled)
            rounded = tl.minimum(tl.maximum(rounded, -LEVELS), LEVELS)
            code = rounded.to(tl.int32) + LEVELS
            decoded = rounded * scale
        tl.store(code_ptr + out, code.to(tl.uint8), mask=chosen)
        tl.store(scale_ptr + tile, scale)
    flat_q = tl.where(chosen, flat_q - decoded, flat_q)
    tl.store(q_ptr + flat_offsets, flat_q, mask=flat_inside)


@torch.library.custom_op("hf_flexdemo::demo_encode", mutates_args=("q",))
def demo_encode_op(
    grads: list[torch.Tensor],
    q: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    noise: torch.Tensor | None,
    tile_rows: int,
    tile_cols: int,
    k: int,
    decay: float,
    lr: float,
    select: bool,
    bits: int,
    wire: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel as one torch operation on the ``(rows, cols)`` momentum ``q`` and ``grads``, the same rows one
    after another in contiguous tensors of one dtype: ``(indices, values, codes, scale)``, each with no rows unless
    ``select`` (``codes`` and ``scale`` also unless ``bits``)."""
    rows, cols = q.shape
    n_tiles = (rows // tile_rows) * (cols // tile_cols)
    picked = n_tiles if select else 0
    indices = torch.empty(picked, k, dtype=torch.int32, device=q.device)
    values = torch.empty(picked, k, dtype=torch.float32, device=q.device)
    codes = torch.empty(picked if bits else 0, k, dtype=torch.uint8, device=q.device)
    scale = torch.empty(picked if bits else 0, dtype=torch.float32, device=q.device)
    a, b = left.shape[0], right.shape[0]
    unused = q  # stands in for the pointers a constexpr branch never touches (an empty tensor may have none)
    _demo_encode_kernel[(n_tiles,)](
        address_table(tuple(g.data_ptr() for g in grads), q.device),
        q,
        left,
        right,
        noise if noise is not None else unused,
        indices if select else unused,
        values if select else unused,
        codes if select and bits else unused,
        scale if select and bits else unused,
        cols,
        cols // tile_cols,
        n_tiles // len(grads),
        decay,
        lr,
        GRAD=dtype_code(grads[0].dtype),
        TILE_ROWS=tile_rows,
        TILE_COLS=tile_cols,
        A=a,
        B=b,
        K=k,
        SELECT=select,
        BITS=bits,
        LEVELS=2 ** (bits - 1) - 1 if bits > 1 else 1,
        STOCHASTIC=noise is not None,
        WIRE=0 if bits else wire,
        PRECISION=dot_precision(q.device),
        num_warps=4,
        enable_fp_fusion=False,  # each product and sum rounded as written, as the torch path's separate operations
    )
    return indices, values, codes, scale


@demo_encode_op.register_fake
def _(grads, q, left, right, noise, tile_rows, tile_cols, k, decay, lr, select, bits, wire):
    picked = (q.shape[0] // tile_rows) * (q.shape[1] // tile_cols) if select else 0
    return (
        q.new_empty(picked, k, dtype=torch.int32),
        q.new_empty(picked, k, dtype=torch.float32),
        q.new_empty(picked if bits else 0, k, dtype=torch.uint8),
        q.new_empty(picked if bits else 0, dtype=torch.float32),
    )


def demo_encode(
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
    """:func:`.demo_encode_torch.demo_encode_torch`, fused (same arguments, same results to float32 rounding).

    ``grad``: the bucket's gradients stacked, or one tensor per parameter, read where they are (no stacked copy).
    """
    if q.dtype != torch.float32:
        raise ValueError(f"FlexDeMo: kernels='triton' keeps the momentum in float32, not {q.dtype}.")
    q = q.view(plan.rows, plan.cols)
    if plan.n_tiles == 0:
        return None
    indices, values, codes, scale = demo_encode_op(
        _readable(grad),
        q,
        padded_dct(plan.tile_rows, q.device),
        padded_dct(plan.tile_cols, q.device),
        noise.float().contiguous() if noise is not None else None,
        plan.tile_rows,
        plan.tile_cols,
        plan.k,
        float(decay),
        float(lr),
        select,
        bits,
        dtype_code(wire_dtype),
    )
    if not select:
        return None
    return EncodedTiles(indices, values, codes if bits else None, scale if bits else None)


def _readable(grad: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients as the kernel reads them: contiguous, of one 16- or 32-bit dtype (copies only where not)."""
    if isinstance(grad, torch.Tensor):
        return [grad.contiguous()]
    dtype = grad[0].dtype if all(g.dtype == grad[0].dtype for g in grad) else torch.float32
    return [g.to(dtype).contiguous() for g in grad]
