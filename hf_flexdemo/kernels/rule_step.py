"""The update rules' pass over a bucket's parameters as one Triton kernel: it must equal :mod:`.rule_step_torch`.

Each program takes ``BLOCK`` entries of one parameter (read through a table of the bucket's parameters'
addresses, so they need not be one tensor, in their own dtype) and of the step, and in registers::

    p  = decay * p                                              weight decay (decay = 1 - lr * weight_decay)
    add_step:   p += alpha * step                               the orthogonal rule: alpha = -lr * its scale
    adam_step:  g = u / lr;  v = beta2 * v + (1 - beta2) * g**2;  p -= lr * g / (sqrt(v / correction) + eps)

so the parameter is read and written once, the step read once (in its own dtype: Newton-Schulz's bf16 result is not
converted first), and adam's second moment read and written once, where the torch path runs eight passes (nine with
weight decay). The decayed parameter is rounded to its dtype before the step is added, as the torch path's separate
``_foreach_mul_`` (whose CPU kernel rounds the factor to a 16-bit dtype first, as it does ``alpha``: see below). The
step is rounded to the parameter's dtype before it is added, as the torch path's ``.to(dtype)``; divisions and the
square root round as IEEE (``div_rn``, ``sqrt_rn``), as torch's. The sum ``p + alpha * step`` is computed in float32
and rounded once, as torch's CUDA ``_foreach_add_``; its CPU kernel rounds ``alpha`` to the dtype of 16-bit
parameters first (see :mod:`.sign_decode_torch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._triton_common import address_table, dtype_code, round_to_dtype

BLOCK = 1024
"""Entries of one parameter per program."""


@triton.jit
def _rule_step_kernel(
    table_ptr,
    step_ptr,
    v_ptr,
    correction_ptr,
    numel,
    blocks_per_param,
    alpha,
    lr,
    beta2,
    one_minus_beta2,
    eps,
    decay,
    BLOCK: tl.constexpr,
    ADAM: tl.constexpr,
    PARAM: tl.constexpr,
    DECAY: tl.constexpr,
):
    program = tl.program_id(0)
    param = program // blocks_per_param
    offsets = (program % blocks_per_param) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    flat = param.to(tl.int64) * numel + offsets
    step = tl.load(step_ptr + flat, mask=inside, other=0.0).to(tl.float32)
    if ADAM:
        g = tl.div_rn(step, tl.full((BLOCK,), 0.0, tl.float32) + lr)  # div_rn: two tensors of one shape
        v = tl.load(v_ptr + flat, mask=inside, other=0.0) * beta2 + one_minus_beta2 * g * g
        tl.store(v_ptr + flat, v, mask=inside)
        correction = tl.load(correction_ptr + param)
        denominator = tl.sqrt_rn(tl.div_rn(v, tl.full((BLOCK,), 0.0, tl.float32) + correction)) + eps
        step = tl.div_rn(g, denominator)
    step = round_to_dtype(step, PARAM)
    address = tl.load(table_ptr + param)
    if PARAM == 1:
        where = address.to(tl.pointer_type(tl.bfloat16)) + offsets
    elif PARAM == 2:
        where = address.to(tl.pointer_type(tl.float16)) + offsets
    else:
        where = address.to(tl.pointer_type(tl.float32)) + offsets
    old = tl.load(where, mask=inside, other=0.0).to(tl.float32)
    if DECAY:
        old = round_to_dtype(old * decay, PARAM)  # as torch's _foreach_mul_: rounded to the dtype
    moved = tl.fma(step, alpha, old)  # as torch's add: one rounding
    tl.store(where, round_to_dtype(moved, PARAM).to(where.dtype.element_ty), mask=inside)


def _launch(params, step, v, correction, alpha, lr, beta2, eps, decay) -> None:
    numel = params[0].numel()
    if numel == 0:
        return
    blocks = triton.cdiv(numel, BLOCK)
    adam = v is not None
    _rule_step_kernel[(len(params) * blocks,)](
        address_table(tuple(p.data_ptr() for p in params), params[0].device),
        step,
        v if adam else step,  # unread unless adam
        correction if adam else step,
        numel,
        blocks,
        alpha,
        lr,
        beta2,
        1 - beta2,
        eps,
        decay,
        BLOCK=BLOCK,
        ADAM=adam,
        PARAM=dtype_code(params[0].dtype),
        DECAY=decay != 1.0,
        num_warps=4,
        enable_fp_fusion=False,  # each product and sum rounded as written, as the torch path's separate operations
    )


@torch.library.custom_op("hf_flexdemo::add_step", mutates_args=("params",))
def add_step_op(params: list[torch.Tensor], step: torch.Tensor, alpha: float, decay: float) -> None:
    """The kernel as one torch operation: ``step`` holds ``params``' entries in order (contiguous)."""
    _launch(params, step, None, None, alpha, 1.0, 0.0, 0.0, decay)


@add_step_op.register_fake
def _(params, step, alpha, decay) -> None:
    return None


@torch.library.custom_op("hf_flexdemo::adam_step", mutates_args=("params", "second_moment"))
def adam_step_op(
    params: list[torch.Tensor],
    update: torch.Tensor,
    second_moment: torch.Tensor,
    correction: torch.Tensor,
    lr: float,
    beta2: float,
    eps: float,
    decay: float,
) -> None:
    """The adam rule's step as one torch operation (``update``, ``second_moment``: ``params``' entries in order)."""
    _launch(params, update, second_moment, correction, -lr, lr, beta2, eps, decay)


@adam_step_op.register_fake
def _(params, update, second_moment, correction, lr, beta2, eps, decay) -> None:
    return None


def add_step(params: Sequence[torch.Tensor], step: torch.Tensor, alpha: float, decay: float = 1.0) -> None:
    """:func:`.rule_step_torch.add_step_torch`, fused (same arguments, the same step to float32 rounding)."""
    add_step_op(list(params), step.contiguous(), float(alpha), float(decay))


def adam_step(
    params: Sequence[torch.Tensor],
    update: torch.Tensor,
    second_moment: torch.Tensor,
    correction: torch.Tensor,
    *,
    lr: float,
    beta2: float,
    eps: float,
    decay: float = 1.0,
) -> None:
    """:func:`.rule_step_torch.adam_step_torch`, fused (``update`` is left as it was)."""
    if second_moment.dtype != torch.float32:
        raise ValueError(
            f"FlexDeMo: kernels='triton' keeps adam's second moment in float32, not {second_moment.dtype}."
        )
    adam_step_op(
        list(params),
        update.contiguous(),
        second_moment,
        correction.to(torch.float32).contiguous(),
        float(lr),
        float(beta2),
        float(eps),
        float(decay),
    )
