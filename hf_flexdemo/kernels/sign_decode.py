"""DeMo's decode as one Triton program per tile: applied by the sign rule (:func:`sign_decode`, which must equal
:func:`.sign_decode_torch.sign_decode_torch`), or stored as the dense update the other rules take
(:func:`demo_decode`, which must equal :func:`.sign_decode_torch.demo_decode_torch`).

The inverse DCT of a sparse tile is a low-rank product. With the ``K = replicas * k`` sent entries of a tile at
rows ``r_e``, columns ``c_e`` (``index = r * tile_cols + c``), values ``v_e``, and ``n_e`` the replicas that sent
position ``(r_e, c_e)`` (``decode='selected'``; ``decode='mean'``: ``n_e = replicas``)::

    U  = L^T[:, r] @ diag(v / n) @ R[c, :]      (tile_rows x K) @ (K x tile_cols), K in blocks of at most 64
    p  = decay * p                               weight decay, rounded to the parameter's dtype as torch's mul
    p  = p - lr * sign(U)                        sign=False: lr * U rounded to the parameter's dtype, as torch

so no dense coefficient matrix is built, and the parameter is read and written once, in place (each parameter
of the bucket through a table of their addresses, so they need not be one tensor). ``n_e`` comes from comparing
every sent position with every other in the tile. A position several replicas sent appears once per replica in
the product, each with its share ``v / n``: the same sum as the torch path's, in another order (float32
rounding). Fixed order, no atomics: every replica computes bitwise the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..compression import ChunkPlan
from . import padded_dct
from ._triton_common import address_table, dot_precision, dtype_code, round_to_dtype, total

BLOCK = 64
"""Most sent entries one product takes at a time (bounds a program's registers whatever ``k`` and replicas)."""


@triton.jit
def _sign_decode_kernel(
    table_ptr,
    out_ptr,
    index_ptr,
    value_ptr,
    left_ptr,
    right_ptr,
    n_tiles,
    cols,
    grid_cols,
    tiles_per_param,
    neg_lr,
    decay,
    REPLICAS: tl.constexpr,
    K: tl.constexpr,
    KB: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr,
    A: tl.constexpr,
    B: tl.constexpr,
    SELECTED: tl.constexpr,
    SIGN: tl.constexpr,
    PARAM: tl.constexpr,
    STORE: tl.constexpr,
    DECAY: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    rows_a = tl.arange(0, A)
    cols_b = tl.arange(0, B)
    block = tl.arange(0, KB)
    update = tl.full((A, B), 0.0, tl.float32)
    for replica in range(REPLICAS):
        for start in range(0, K, KB):
            entry = start + block
            valid = entry < K
            index = tl.load(index_ptr + (replica * n_tiles + tile).to(tl.int64) * K + entry, mask=valid, other=-1)
            value = tl.load(value_ptr + (replica * n_tiles + tile).to(tl.int64) * K + entry, mask=valid, other=0.0)
            value = value.to(tl.float32)
            if SELECTED:
                senders = tl.full((KB,), 0, tl.int32)
                for other in range(REPLICAS):
                    for start2 in range(0, K, KB):
                        entry2 = start2 + block
                        where2 = (other * n_tiles + tile).to(tl.int64) * K + entry2
                        index2 = tl.load(index_ptr + where2, mask=entry2 < K, other=-2)
                        senders += total((index[:, None] == index2[None, :]).to(tl.int32), axis=1)
                share = tl.div_rn(value, tl.maximum(senders, 1).to(tl.float32))
            else:
                share = tl.div_rn(value, tl.full((KB,), REPLICAS, tl.float32))
            row = tl.where(valid, index // TILE_COLS, 0)
            col = tl.where(valid, index % TILE_COLS, 0)
            left_t = tl.load(left_ptr + row[None, :] * A + rows_a[:, None])  # L^T[m, e] = L[r_e, m]
            right = tl.load(right_ptr + col[:, None] * B + cols_b[None, :])  # R[c_e, n]
            update += tl.dot(left_t * share[None, :], right, input_precision=PRECISION)

    i = rows_a[:, None]
    j = cols_b[None, :]
    inside = (i < TILE_ROWS) & (j < TILE_COLS)
    if STORE:  # the dense update for another rule: the tile of the stacked (rows, cols) float32 output
        base = (tile // grid_cols).to(tl.int64) * TILE_ROWS * cols + (tile % grid_cols) * TILE_COLS
        tl.store(out_ptr + base + i * cols + j, update, mask=inside)
    else:  # an else, not a return: the compiler then drops this branch, whose table is no address table when storing
        if SIGN:
            step = tl.where(update > 0, 1.0, tl.where(update < 0, -1.0, 0.0))
        else:
            step = round_to_dtype(update, PARAM)
        local = tile % tiles_per_param
        base = (local // grid_cols).to(tl.int64) * TILE_ROWS * cols + (local % grid_cols) * TILE_COLS
        address = tl.load(table_ptr + tile // tiles_per_param)
        if PARAM == 1:
            where = address.to(tl.pointer_type(tl.bfloat16)) + base + i * cols + j
        elif PARAM == 2:
            where = address.to(tl.pointer_type(tl.float16)) + base + i * cols + j
        else:
            where = address.to(tl.pointer_type(tl.float32)) + base + i * cols + j
        old = tl.load(where, mask=inside, other=0.0).to(tl.float32)
        if DECAY:
            old = round_to_dtype(old * decay, PARAM)
        moved = old + neg_lr * step
        tl.store(where, round_to_dtype(moved, PARAM).to(where.dtype.element_ty), mask=inside)


@torch.library.custom_op("hf_flexdemo::sign_decode", mutates_args=("params",))
def sign_decode_op(
    params: list[torch.Tensor],
    indices: torch.Tensor,
    values: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    cols: int,
    tile_rows: int,
    tile_cols: int,
    selected: bool,
    lr: float,
    sign: bool,
    decay: float,
) -> None:
    """The kernel as one torch operation: ``indices`` and ``values`` are ``(replicas, n_tiles, k)``, ``params`` the
    bucket's contiguous parameters (each ``rows x cols`` of the plan, stacked by rows)."""
    table = address_table(tuple(p.data_ptr() for p in params), params[0].device)
    _launch(table, None, indices, values, left, right, cols, tile_rows, tile_cols, selected, lr, sign, params, decay)


@sign_decode_op.register_fake
def _(params, indices, values, left, right, cols, tile_rows, tile_cols, selected, lr, sign, decay) -> None:
    return None


@torch.library.custom_op("hf_flexdemo::demo_decode", mutates_args=())
def demo_decode_op(
    indices: torch.Tensor,
    values: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    rows: int,
    cols: int,
    tile_rows: int,
    tile_cols: int,
    selected: bool,
) -> torch.Tensor:
    """The same kernel storing the decoded update ``U`` (float32, ``rows x cols``) instead of applying it."""
    out = torch.empty(rows, cols, dtype=torch.float32, device=values.device)
    _launch(indices, out, indices, values, left, right, cols, tile_rows, tile_cols, selected, 0.0, True, [out], 1.0)
    return out


@demo_decode_op.register_fake
def _(indices, values, left, right, rows, cols, tile_rows, tile_cols, selected) -> torch.Tensor:
    return values.new_empty(rows, cols, dtype=torch.float32)


def _launch(
    table, out, indices, values, left, right, cols, tile_rows, tile_cols, selected, lr, sign, params, decay
) -> None:
    """One program per tile: apply to ``params`` (their addresses in ``table``), or store into ``out`` (when given,
    as ``params``'s one tensor)."""
    replicas, n_tiles, k = indices.shape
    _sign_decode_kernel[(n_tiles,)](
        table,
        out if out is not None else values,  # unread unless storing
        indices,
        values,
        left,
        right,
        n_tiles,
        cols,
        cols // tile_cols,
        n_tiles // len(params),
        -lr,
        decay,
        REPLICAS=replicas,
        K=k,
        KB=max(16, min(BLOCK, 1 << (k - 1).bit_length())),
        TILE_ROWS=tile_rows,
        TILE_COLS=tile_cols,
        A=left.shape[0],
        B=right.shape[0],
        SELECTED=selected and replicas > 1,
        SIGN=sign,
        PARAM=dtype_code(params[0].dtype),
        STORE=out is not None,
        DECAY=decay != 1.0,
        PRECISION=dot_precision(values.device),
        num_warps=4,
        enable_fp_fusion=False,  # each product and sum rounded as written, as the torch path's separate operations
    )


def sign_decode(
    params: Sequence[torch.Tensor],
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    plan: ChunkPlan,
    *,
    mode: str,
    lr: float,
    sign: bool,
    decay: float = 1.0,
) -> None:
    """:func:`.sign_decode_torch.sign_decode_torch`, fused (same arguments, the same step to float32 rounding)."""
    if plan.n_tiles == 0:
        return
    sign_decode_op(
        list(params),
        *_kernel_inputs(parts, plan),
        plan.cols,
        plan.tile_rows,
        plan.tile_cols,
        mode == "selected",
        float(lr),
        sign,
        float(decay),
    )


def demo_decode(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], plan: ChunkPlan, *, mode: str, dtype=torch.float32
) -> torch.Tensor:
    """:func:`.sign_decode_torch.demo_decode_torch`, fused: the decoded update, float32, ``plan.rows x plan.cols``.

    What the orthogonal and adam rules take: one write of the update, where the torch path zeroes a dense
    coefficient matrix, scatters into it and runs two matrix products over it.
    """
    assert dtype == torch.float32, "the kernels keep float32 momentum (float64 parameters are refused)"
    if plan.n_tiles == 0:
        return torch.zeros(plan.rows, plan.cols, dtype=torch.float32, device=parts[0][1].device)
    return demo_decode_op(
        *_kernel_inputs(parts, plan),
        plan.rows,
        plan.cols,
        plan.tile_rows,
        plan.tile_cols,
        mode == "selected",
    )


def _kernel_inputs(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], plan: ChunkPlan) -> tuple[torch.Tensor, ...]:
    """Every replica's indices and values as ``(replicas, n_tiles, k)``, and the tile's padded DCT matrices."""
    indices = torch.stack([index.to(torch.int32) for index, _ in parts])
    values = torch.stack([value for _, value in parts])
    shape = (len(parts), plan.n_tiles, plan.k)
    left, right = padded_dct(plan.tile_rows, values.device), padded_dct(plan.tile_cols, values.device)
    return indices.view(shape), values.view(shape), left, right
