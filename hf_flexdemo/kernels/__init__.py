"""Fused Triton kernels for DeMo's passes over the momentum, each beside the plain torch function it must equal.

The setting ``kernels`` (:class:`hf_flexdemo.FlexDeMoConfig`) picks the implementation, here, in one place:
``"torch"`` (the default) runs a step as torch operations; ``"triton"`` runs, one program per tile of a bucket,

- :mod:`.demo_encode`: ``Q = decay*Q + lr*DCT(grad)``, the top-k of ``|Q|``, their quantization for the wire and
  the error feedback, in one pass over the gradient and the momentum (scheme ``demo``, every update rule and wire
  format);
- :mod:`.sign_decode`: every replica's ``(indices, values)`` of a tile decoded and applied, ``p -= lr * sign(U)``
  (``lr * U`` with ``sign=False``), with no dense coefficient matrix (``update='sign'``; the other rules take
  the dense decode, :meth:`hf_flexdemo.schemes.base.SparseCoefficients.dense`, written once by the same kernel);
- :mod:`.rule_step`: the other rules' pass over the parameters, one program per block of a parameter: the
  orthogonal rule's ``p += alpha * step``, or adam's normalisation and step with its second moment.

Each kernel module holds the torch function it must equal (``*_torch``), which the tests compare it with.
Importing this package does not import Triton: a kernel module is imported on first use, so that
``TRITON_INTERPRET=1`` (Triton's interpreter, which runs kernels on CPU tensors: for tests) can be set before.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from ..compression import dct_matrix
from ..scheme_traits import schemes_where, traits_of

KERNELS = ("torch", "triton")
"""Values of the setting ``kernels``."""

MAX_TILE_SIDE = 64
"""Largest tile side the kernels take (``chunk``): a program holds a whole tile and its DCT matrices (a 64 x 64
tile's encode takes 48 KiB of shared memory on an H100; a 128 x 128 one would take 192 KiB, beyond an A100's)."""

_INTERPRET_ON = ("1", "true", "yes", "on", "y")


def interpreting() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET=1``): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _INTERPRET_ON


def triton_missing(device: torch.device | None = None) -> str | None:
    """Why ``kernels='triton'`` cannot run here (on ``device``; None: on this machine), or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton; torch's CUDA wheels bring it)"
    if device is None:
        if torch.cuda.is_available() or interpreting():
            return None
        return "this machine has no CUDA GPU, and TRITON_INTERPRET=1 (Triton's slow CPU interpreter) is not set"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return "the parameters are on the CPU, where Triton runs only under TRITON_INTERPRET=1 (its slow interpreter)"
    return f"the parameters are on {device.type!r}; the kernels run on CUDA devices (or the CPU, interpreted)"


def check_settings(*, scheme: str, chunk: int) -> None:
    """Refuse ``kernels='triton'`` where it cannot run or would run nothing (ValueError naming the setting)."""
    fix = "write kernels='torch' (the default)"
    if not traits_of(scheme).fused_kernels:
        names = " or ".join(repr(name) for name in schemes_where("fused_kernels"))
        raise ValueError(
            f"FlexDeMo: kernels='triton' fuses the passes of scheme={names}, so with scheme={scheme!r} it would be "
            f"ignored; {fix}, or scheme={names}."
        )
    check_chunk(chunk)
    why = triton_missing()
    if why is not None:
        raise ValueError(f"FlexDeMo: kernels='triton' cannot run: {why}; {fix}.")


def check_chunk(chunk: int) -> None:
    if chunk > MAX_TILE_SIDE:
        raise ValueError(
            f"FlexDeMo: chunk={chunk} cannot be combined with kernels='triton': its programs hold whole tiles, of "
            f"sides up to {MAX_TILE_SIDE}; set chunk <= {MAX_TILE_SIDE}, or kernels='torch'."
        )


def check_bucket(device: torch.device, dtype: torch.dtype, chunk: int) -> None:
    """At the first step (the parameters' final device known): refuse what the kernels cannot take."""
    why = triton_missing(device)
    if why is not None:
        raise ValueError(f"FlexDeMo: kernels='triton' cannot run: {why}; write kernels='torch' (the default).")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"FlexDeMo: kernels='triton' computes in float32 (momentum of 16- and 32-bit parameters); parameters "
            f"of dtype {dtype} keep a {dtype} momentum: write kernels='torch' for them."
        )
    check_chunk(chunk)


def padded_side(n: int) -> int:
    """A tile side as a kernel holds it: the next power of two, at least 16 (``tl.arange``, ``tl.dot``)."""
    return max(16, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=64)
def padded_dct(n: int, device: torch.device) -> torch.Tensor:
    """The float32 DCT-II matrix of side ``n`` in the top-left corner of zeros of side :func:`padded_side`.

    Zero padding keeps the transform exact on the real entries: padded rows and columns add nothing.
    """
    side = padded_side(n)
    out = torch.zeros(side, side, dtype=torch.float32, device=device)
    out[:n, :n] = dct_matrix(n, torch.float32, device)
    return out


def encoder(kernels: str) -> Callable:
    """The function that runs DeMo's encode pass (:func:`.demo_encode.demo_encode_torch`'s signature)."""
    if kernels == "triton":
        from .demo_encode import demo_encode

        return demo_encode
    from .demo_encode_torch import demo_encode_torch

    return demo_encode_torch


def sign_decoder() -> Callable:
    """The fused decode-and-apply of the sign rule (:func:`.sign_decode.sign_decode`)."""
    from .sign_decode import sign_decode

    return sign_decode


def dense_decoder(kernels: str) -> Callable:
    """The function that makes DeMo's received parts a dense update (:func:`.sign_decode_torch.demo_decode_torch`'s
    signature): what the rules other than ``sign`` take."""
    if kernels == "triton":
        from .sign_decode import demo_decode

        return demo_decode
    from .sign_decode_torch import demo_decode_torch

    return demo_decode_torch


def step_adder(kernels: str) -> Callable:
    """``p += alpha * step`` over a bucket's parameters (:func:`.rule_step_torch.add_step_torch`'s signature)."""
    if kernels == "triton":
        from .rule_step import add_step

        return add_step
    from .rule_step_torch import add_step_torch

    return add_step_torch


def adam_stepper(kernels: str) -> Callable:
    """The adam rule's step over a bucket (:func:`.rule_step_torch.adam_step_torch`'s signature)."""
    if kernels == "triton":
        from .rule_step import adam_step

        return adam_step
    from .rule_step_torch import adam_step_torch

    return adam_step_torch
