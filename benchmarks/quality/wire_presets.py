"""Bytes per step of each ``wire=`` preset for a real model's shapes, and the link each one suits.

Each parameter of the model (built on the meta device: shapes only, no download) is tiled as
FlexDeMo tiles it; a selection of ``(n_tiles, k)`` zeros goes through the real wire
(``TopKWire.pack``), so the bytes are what one node sends each step, exactly. Against it: the
dense all-reduce of bf16 gradients (2 nodes: each node sends the gradient once either way). Both
figures and their ratio come from the functions the optimizer's logged ``flexdemo/x_fewer_than_bf16_dense``
uses (:mod:`hf_flexdemo.optim.counters`), so the log and this table agree. The link at which the exchange takes as long as the
step's compute is ``bytes * 8 / compute``: below it the link bounds the step, and a more
compressed preset is faster. The compute per step (``--compute_ms``, default 380 ms) is OLMo2-1B's
forward and backward plus the default rule's step, measured on one H200 (BENCHMARKS.md).

    .venv/bin/python benchmarks/quality/wire_presets.py --model olmo2-1b \\
        --json benchmarks/results/quality/wire_presets.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "step"))  # benchmarks/step: the model builder

from gpu_step import build_model  # noqa: E402

from hf_flexdemo.compression import ChunkPlan
from hf_flexdemo.config import NAMED_WIRES, FlexDeMoConfig
from hf_flexdemo.optim.counters import ByteCounters, bf16_dense_bytes, x_fewer_than_bf16_dense
from hf_flexdemo.schemes import build_scheme
from hf_flexdemo.schemes.sparse_wire import TopKWire

NODES = 2


def preset_bytes(shapes: list[torch.Size], preset: str, replicas: int = NODES) -> int:
    """Bytes one node sends per step with ``wire=preset`` among ``replicas`` nodes (every parameter)."""
    config = FlexDeMoConfig(wire=preset)
    wire = TopKWire(config)
    payload = 0
    for shape in shapes:
        plan = ChunkPlan.for_shape(shape, config.chunk, config.topk, config.scale_topk)
        if plan.n_tiles == 0:
            continue
        indices = torch.zeros(plan.n_tiles, plan.k, dtype=torch.int64)
        values = torch.zeros(plan.n_tiles, plan.k)
        sent, _ = wire.encode(indices, values, plan, torch.float32)
        payload += sum(t.numel() * t.element_size() for t in sent)
    return ByteCounters(build_scheme(config).collective).wire_bytes(payload, replicas)


def dense_bytes(shapes: list[torch.Size], replicas: int = NODES) -> int:
    """What the dense bf16 all-reduce of the same gradients sends per node and step (the table's baseline)."""
    return bf16_dense_bytes(sum(shape.numel() for shape in shapes), replicas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="olmo2-1b", choices=["olmo2-1b", "t5-small"])
    parser.add_argument("--compute_ms", type=float, default=380.0, help="the step's compute, for the link it suits")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shapes = [p.shape for p in build_model(args.model).parameters()]
    dense = dense_bytes(shapes)
    rows = []
    print(f"{args.model}: {dense / 1e9:.2f} GB of bf16 gradients per step (a dense all-reduce, 2 nodes)")
    print("| wire | MB per step | x fewer than dense | at 100 Mbit/s | at 1 Gbit/s | the link bounds the step below |")
    for name in NAMED_WIRES:  # the presets, and demo for reference
        sent = preset_bytes(shapes, name)
        row = {
            "wire": name,
            "bytes_per_step": sent,
            "x_fewer_than_dense": x_fewer_than_bf16_dense(sent, dense),
            "seconds_at_100mbit": sent * 8 / 100e6,
            "seconds_at_1gbit": sent * 8 / 1e9,
            "bound_below_mbit": sent * 8 / (args.compute_ms / 1e3) / 1e6,
        }
        rows.append(row)
        print(
            f"| `{name}` | {sent / 1e6:.1f} | {row['x_fewer_than_dense']:.0f}x | {row['seconds_at_100mbit']:.2f} s "
            f"| {row['seconds_at_1gbit']:.3f} s | {row['bound_below_mbit']:.0f} Mbit/s |"
        )
    print(f"| dense all-reduce | {dense / 1e6:.0f} | 1x | {dense * 8 / 100e6:.0f} s | {dense * 8 / 1e9:.1f} s | "
          f"{dense * 8 / (args.compute_ms / 1e3) / 1e9:.0f} Gbit/s |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "dense_bytes": dense, "presets": rows}, indent=1))


if __name__ == "__main__":
    main()
