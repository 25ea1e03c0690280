"""Small ``@triton.jit`` helpers the kernels share: rounding as torch rounds, on a GPU and in the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl

WIRE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
"""A 16- or 32-bit float dtype as the kernels' constexpr ``DTYPE`` (by ``str(dtype)`` without ``torch.``)."""


def dtype_code(dtype) -> int:
    return WIRE_CODES[str(dtype).removeprefix("torch.")]


@triton.jit
def round_to_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), still as float32: as torch's ``.to(bfloat16)``.

    Integer arithmetic on the bit pattern, so the interpreter (which truncates in ``.to(tl.bfloat16)``) and a GPU
    round alike.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to the dtype ``DTYPE`` (:data:`WIRE_CODES`), still as float32."""
    if DTYPE == 1:
        return round_to_bf16(x)
    elif DTYPE == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def round_half_even(x):
    """``torch.round`` (nearest, ties to even) of float32 ``x`` with ``|x| < 2**22``; the interpreter has no rint."""
    low = tl.floor(x)
    frac = x - low  # exact where it decides: |x| >= 1 (Sterbenz), or x in (-1, 1) apart from ties that round up
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, low + 1.0, low)
