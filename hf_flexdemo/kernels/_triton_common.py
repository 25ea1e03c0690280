"""Small ``@triton.jit`` helpers the kernels share: rounding as torch rounds, on a GPU and in the interpreter.

The reductions here stand in for ``tl.sum``, ``tl.max`` and ``tl.cumsum`` (and the kernels write ``tl.full`` for
``tl.zeros``): Triton's standard library defines those with ``@triton.jit`` when ``triton.language`` is first
imported, so a process that imported it before setting ``TRITON_INTERPRET=1`` (``from transformers import Trainer``
does) holds compiled-only versions, which an interpreted kernel cannot call. ``tl.reduce`` and
``tl.associative_scan`` are builtins; given the standard library's own combine functions (private names, imported
below: a rename fails the kernels' tests at once), the interpreter takes its numpy fast path and a GPU compiles
them as it compiles ``tl.sum``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

WIRE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
"""A 16- or 32-bit float dtype as the kernels' constexpr ``DTYPE`` (by ``str(dtype)`` without ``torch.``)."""


def dtype_code(dtype) -> int:
    return WIRE_CODES[str(dtype).removeprefix("torch.")]


@functools.lru_cache(maxsize=16)
def dot_precision(device: torch.device) -> str:
    """``tl.dot``'s ``input_precision`` on ``device``: ``"tf32x3"`` on NVIDIA GPUs with TF32 (compute capability 8.0
    or newer), ``"ieee"`` elsewhere (the interpreter, older or AMD GPUs).

    Three TF32 products carry about float32's accuracy on the tensor cores: on an H200 the sign step with the kernels
    took 36 ms instead of 47 ms, and the kernels' GPU tests pass at the same tolerances (issue 46). Plain TF32 would
    differ from the torch path by more than float32 rounding.
    """
    if device.type != "cuda" or torch.version.hip is not None:
        return "ieee"
    return "tf32x3" if torch.cuda.get_device_capability(device) >= (8, 0) else "ieee"


@functools.lru_cache(maxsize=1024)
def address_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The parameters' addresses on their device, for a kernel that reaches a bucket's parameters through them
    (kept: a bucket's parameters keep their storage between steps)."""
    return torch.tensor(addresses, dtype=torch.int64, device=device)


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


@triton.jit
def total(x, axis: tl.constexpr):
    """``tl.sum(x, axis)``."""
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def largest(x, axis: tl.constexpr):
    """``tl.max(x, axis)``."""
    return tl.reduce(x, axis, _elementwise_max)


@triton.jit
def running_total(x, axis: tl.constexpr):
    """``tl.cumsum(x, axis)``: inclusive."""
    return tl.associative_scan(x, axis, _sum_combine)
