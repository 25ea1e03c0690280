"""Memory traffic of one optimizer step on OLMo2's layout, in bytes read and written per parameter, counted on CPU.

    # OLMo2-1B's 16 layers at width 256, vocabulary 4096 (18.9M parameters), in bf16 and in fp32
    python benchmarks/step/step_traffic.py
    python benchmarks/step/step_traffic.py --dtypes bf16 --configs sign --json traffic.json
    # with FlexDeMo's fused Triton path on the CPU (Triton's interpreter: minutes a configuration)
    TRITON_INTERPRET=1 python benchmarks/step/step_traffic.py --layers 2 --configs sign "sign, fused"

A step of a bandwidth-bound optimizer costs about its bytes moved: this counts them without a GPU.
Parameters are built from ``benchmarks/step/step_ops.py``'s OLMo2 layout (one process, no
``torch.distributed``), here with a vocabulary of 4096 tokens: the embedding and head (which take
the element-wise rule) then hold 11% of the parameters, nearer OLMo2-1B's 28% (100k tokens at
width 2048) than 1024 tokens' 3%. The default rule's bytes per parameter depend on that share;
those of ``sign`` and AdamW hardly at all, nor on the number of layers. Each configuration takes
one warm-up step (so its lazy state exists), then its second step is counted. Deterministic random
gradients of the parameter dtype are set before each step, outside the count.

The counting rule (``StepTraffic``, a ``TorchDispatchMode``: it sees each aten operation that
reaches the dispatcher's Python key, composite operations already decomposed):

- an operation whose outputs alias its inputs (a view: ``OpOverload.is_view``, which reads the
  schema's alias annotations), an in-place view (``torch.Tag.inplace_view``) and the few other
  metadata-only operations in ``METADATA_OPS`` (``empty``, ``_unsafe_view``, ``resize_``, ...) count
  nothing, nor do the profiler's ``record_function`` markers;
- every other operation reads every tensor argument (tensors inside lists included) and writes
  every tensor output, each counted as ``numel * element_size`` of the tensor as passed (a view's
  own extent, whatever its storage);
- an argument the schema marks as mutated (``Tensor(a!)``: in-place and ``out=`` operations) is
  written, and read as well, except an ``out=`` argument and the destination of the pure
  overwrites in ``OVERWRITE_OPS`` (``copy_``, ``fill_``, ``zero_``), which are written only. An
  output that is a mutated argument returned again is not counted twice;
- a mutated argument counts whole, however few of its entries the operation touches (a
  ``scatter_`` into a large tensor counts that tensor read and written): an upper bound there;
- an operation made with ``torch.library.custom_op`` or ``triton_op`` reaches the mode as one
  operation, so its real inputs and outputs count, not its insides.

Fused AdamW counts 16 bytes per bf16 parameter (32 in fp32): it reads parameter, gradient and both
moments, and writes parameter, both moments and the gradient, which its schema marks as mutated
(``Tensor(b!)[] grads``; a kernel that leaves the gradient alone would move 14).

``default outside NS`` is the default rule's traffic minus what runs inside
``hf_flexdemo.updates.orthogonal.newton_schulz`` (compute-bound products, not a fused kernel's
business): the benchmark wraps that function to move the count to a bucket of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from step_ops import flexdemo_optimizer, olmo2_shapes, random_grads, random_parameters
from torch.utils._python_dispatch import TorchDispatchMode

from hf_flexdemo import FlexDeMo, FlexDeMoConfig
from hf_flexdemo.updates import orthogonal

BASELINE = "fused AdamW"

CONFIGS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    BASELINE: (torch.optim.AdamW, {"fused": True}),
    # The rules on DeMo's wire (32 values a tile as numbers): the rule's own traffic, which the targets hold.
    "sign": (FlexDeMo, {"update": "sign", "wire": "demo"}),
    # orthogonal, adam for the rest (the embedding and head too); Newton-Schulz in bf16, as on a GPU
    "default": (FlexDeMo, {"ns_dtype": "bf16", "wire": "demo"}),
    # the default rule on the default wire: the 4-bit codes and Elias-Fano indices add their coding (no target)
    "default, default wire": (FlexDeMo, {"ns_dtype": "bf16"}),
}
"""Configurations by name: optimizer class and its keyword arguments (besides lr and weight decay).
A configuration's target (``TARGETS``) is its rule's: the name before a comma (``sign, fused`` -> ``sign``)."""

FUSED_CONFIGS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "sign, fused": (FlexDeMo, {"update": "sign", "kernels": "triton", "wire": "demo"}),
    "default, fused": (FlexDeMo, {"ns_dtype": "bf16", "kernels": "triton", "wire": "demo"}),
}
"""FlexDeMo's fused Triton path: in ``CONFIGS`` where this FlexDeMo has the setting ``kernels``, counted where
Triton can run (a CUDA GPU, or the CPU under ``TRITON_INTERPRET=1``)."""

if "kernels" in {f.name for f in dataclasses.fields(FlexDeMoConfig)}:
    CONFIGS.update(FUSED_CONFIGS)

TARGETS: dict[str, float] = {
    "sign": 18.0,  # the fused path's target (issue 46; 24 in issue 34)
    "default outside NS": 32.0,
}
"""Bytes per bf16 parameter a step should stay within."""

TARGET_DTYPE = "bf16"

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

NS_BUCKET = "newton_schulz"

METADATA_OPS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "resize_as_",
        "set_",
        "_unsafe_view",
        "is_same_size",
        "result_type",
    }
)
"""Operations that only allocate, reshape or inspect: no tensor data moves (the views are found by schema)."""

OVERWRITE_OPS = frozenset({"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_"})
"""In-place operations that write their destination without reading it."""


def unavailable(config: str) -> str | None:
    """Why ``config`` cannot run here, or None."""
    if CONFIGS[config][1].get("kernels") == "triton":
        from hf_flexdemo.kernels import triton_missing

        return triton_missing()
    return None


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def op_traffic(func, args: tuple, kwargs: dict, out) -> tuple[int, int] | None:
    """Bytes ``(read, written)`` by one call of the aten operation ``func``; ``None`` for a view or metadata op."""
    name = func.overloadpacket.__name__
    if func.is_view or torch.Tag.inplace_view in func.tags or name in METADATA_OPS or func.namespace == "profiler":
        return None
    read = written = 0
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        tensors = list(_tensors(value))
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        if not mutated or not (arg.is_out or name in OVERWRITE_OPS):
            read += _nbytes(tensors)
        if mutated:
            written += _nbytes(tensors)
    outputs = out if isinstance(out, (list, tuple)) else (out,)
    for ret, value in zip(func._schema.returns, outputs):
        if ret.alias_info is None:  # else it is a mutated argument returned again, counted above
            written += _nbytes(_tensors(value))
    return read, written


class StepTraffic(TorchDispatchMode):
    """Sums the bytes each aten operation reads and writes (the rule is in the module docstring).

    ``bucket`` names where the count goes; ``read``, ``written`` and ``by_op`` are kept per bucket.
    """

    def __init__(self):
        super().__init__()
        self.bucket = "step"
        self.read: Counter = Counter()
        self.written: Counter = Counter()
        self.by_op: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        traffic = op_traffic(func, args, kwargs, out)
        if traffic is not None:
            self.read[self.bucket] += traffic[0]
            self.written[self.bucket] += traffic[1]
            self.by_op[self.bucket][str(func)] += sum(traffic)
        return out

    def total(self, bucket: str | None = None) -> int:
        if bucket is None:
            return sum(self.read.values()) + sum(self.written.values())
        return self.read[bucket] + self.written[bucket]


@contextmanager
def newton_schulz_in_own_bucket(mode: StepTraffic):
    """Counts what runs inside ``orthogonal.newton_schulz`` in ``mode``'s bucket ``NS_BUCKET``."""
    original = orthogonal.newton_schulz

    def counted(*args, **kwargs):
        outer, mode.bucket = mode.bucket, NS_BUCKET
        try:
            return original(*args, **kwargs)
        finally:
            mode.bucket = outer

    with mock.patch.object(orthogonal, "newton_schulz", counted):
        yield


def count_step(step: Callable[[], None]) -> StepTraffic:
    """The traffic of one call of ``step``."""
    with StepTraffic() as mode, newton_schulz_in_own_bucket(mode):
        step()
    return mode


def build_optimizer(config: str, params: list[torch.nn.Parameter], vocab: int) -> torch.optim.Optimizer:
    cls, kwargs = CONFIGS[config]
    if cls is FlexDeMo:
        return flexdemo_optimizer(params, vocab, kwargs)
    return cls(params, lr=1e-3, weight_decay=0.01, **kwargs)


def steady_step_traffic(
    config: str, shapes: list[torch.Size], vocab: int, dtype: torch.dtype, seed: int = 0
) -> tuple[StepTraffic, int]:
    """The traffic of ``config``'s second step on parameters of ``shapes`` in ``dtype``, and the number of parameters.
    The first step builds the lazy state; every step after it counts the same bytes (the third equalled the second
    on every configuration, 2026-12-02)."""
    g = torch.Generator().manual_seed(seed)
    params = random_parameters(shapes, g, dtype)
    opt = build_optimizer(config, params, vocab)

    def set_grads():
        for p, grad in zip(params, random_grads(params, g)):
            p.grad = grad

    set_grads()
    opt.step()  # warm-up: the lazy state
    set_grads()
    return count_step(opt.step), sum(p.numel() for p in params)


def measure(configs: list[str], layers: int, hidden_size: int, vocab: int, dtypes: list[str]) -> list[dict]:
    """Records ``config, param_dtype, bytes_per_param, x_fused_adamw``, with ``<config> outside NS`` where NS ran."""
    shapes, vocab = olmo2_shapes(layers, hidden_size, vocab)
    records = []
    for dtype_name in dtypes:
        figures: dict[str, float] = {}
        for config in [BASELINE] + [c for c in configs if c != BASELINE]:
            mode, numel = steady_step_traffic(config, shapes, vocab, DTYPES[dtype_name])
            figures[config] = mode.total() / numel
            if mode.total(NS_BUCKET):
                figures[f"{config} outside NS"] = (mode.total() - mode.total(NS_BUCKET)) / numel
        for config, per_param in figures.items():
            if config == BASELINE and BASELINE not in configs:
                continue
            records.append(
                {
                    "config": config,
                    "param_dtype": dtype_name,
                    "bytes_per_param": round(per_param, 2),
                    "x_fused_adamw": round(per_param / figures[BASELINE], 2),
                }
            )
    return records


def target_for(record: dict) -> float | None:
    """The target of a record's rule: its name without what follows a comma (``sign, fused`` -> ``sign``)."""
    if record["param_dtype"] != TARGET_DTYPE:
        return None
    name = record["config"]
    outside = " outside NS" if name.endswith(" outside NS") else ""
    return TARGETS.get(name.removesuffix(" outside NS").split(",")[0] + outside)


def print_table(records: list[dict]) -> None:
    print("| config | param dtype | bytes/param | x fused AdamW | target | |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in records:
        target = target_for(r)
        verdict = "" if target is None else ("PASS" if r["bytes_per_param"] <= target else "MISS")
        target_text = "" if target is None else f"{target:g}"
        print(
            f"| {r['config']} | {r['param_dtype']} | {r['bytes_per_param']:.1f} | {r['x_fused_adamw']:.2f} "
            f"| {target_text} | {verdict} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="default: all that can run here (fused AdamW is counted anyway, for the ratio)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the records there")
    args = parser.parse_args()
    if args.configs is None:
        args.configs = [c for c in CONFIGS if not unavailable(c)]
        for config in CONFIGS:
            if unavailable(config):
                print(f"not counted: {config!r}: {unavailable(config)}")
    for config in args.configs:
        if unavailable(config):
            parser.error(f"{config!r} cannot run here: {unavailable(config)}")
    shapes, _ = olmo2_shapes(args.layers, args.hidden_size, args.vocab)
    numel = sum(s.numel() for s in shapes)
    print(
        f"OLMo2 layout: {args.layers} layers, width {args.hidden_size}, vocabulary {args.vocab}, "
        f"{len(shapes)} tensors, {numel / 1e6:.1f}M parameters; the second step, one process, CPU, dispatch-mode count"
    )
    records = measure(args.configs, args.layers, args.hidden_size, args.vocab, args.dtypes)
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
