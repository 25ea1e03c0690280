"""Where a DeMo step spends its time, phase by phase, on one process's FSDP shard of T5-small.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step/demo_phases.py --shards 2

Each parameter's first dimension is cut by ``--shards`` (what one process of a node holds
under FSDP2); tensors of one shape are stacked into a bucket, as the optimizer does, and each
phase of the DeMo update runs once per bucket: the DCT of the gradient, the per-tile top-k,
error feedback, decoding two replicas' parts, the inverse DCT, the signed update, and the
default rule's Newton-Schulz on the 2-D buckets (bf16 and float32). Medians over ``--repeats``
runs, in ms. Single-threaded by default, as in the link benchmark (4 processes on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness

from harness import t5_small_shapes  # noqa: E402

from hf_flexdemo.compression import (
    ChunkPlan,
    decode_replicas,
    flat_positions,
    from_coefficients,
    select_topk,
    to_coefficients,
)
from hf_flexdemo.updates.orthogonal import scaled_newton_schulz


def median_ms(fn, repeats: int, sync=lambda: None) -> float:
    """Median wall time of ``fn`` in ms; ``sync`` waits for the device (``torch.cuda.synchronize``)."""
    fn()  # warm-up: allocations and cached DCT matrices
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def phase_functions(grads: list[torch.Tensor], chunk: int, topk: int) -> dict:
    """DeMo's update, phase by phase, over ``grads`` (one process's shards), two replicas decoded.

    As the optimizer runs it: tensors of one shape stacked into a bucket, each phase once per bucket.
    """
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_shape.setdefault(tuple(g.shape), []).append(g)
    stacks = [torch.stack(same) for same in by_shape.values()]
    plans = [ChunkPlan.for_shape(s.shape[1:], chunk, topk).stacked(s.shape[0]) for s in stacks]
    coefficients = [to_coefficients(g, p) for g, p in zip(stacks, plans)]
    parts = [select_topk(q, p) for q, p in zip(coefficients, plans)]
    decoded = [decode_replicas([part, part], p, "selected", torch.float32) for part, p in zip(parts, plans)]
    matrices = [d.view(s.shape) for d, s in zip(decoded, stacks) if s.dim() == 3]

    def signed_update():
        for g, d in zip(stacks, decoded):
            g.view(d.shape).sub_(torch.sign(d).to(g.dtype), alpha=1e-9)

    return {
        "DCT of the gradient": lambda: [to_coefficients(g, p) for g, p in zip(stacks, plans)],
        "top-k per tile": lambda: [select_topk(q, p) for q, p in zip(coefficients, plans)],
        "error feedback": lambda: [
            q.view(-1).index_add_(0, flat_positions(i, p), v.reshape(-1), alpha=-1.0)
            for q, (i, v), p in zip(coefficients, parts, plans)
        ],
        "decode 2 replicas": lambda: [
            decode_replicas([part, part], p, "selected", torch.float32) for part, p in zip(parts, plans)
        ],
        "inverse DCT": lambda: [from_coefficients(d, p) for d, p in zip(decoded, plans)],
        "sign and update": signed_update,
        "Newton-Schulz bf16": lambda: [scaled_newton_schulz(m, torch.bfloat16) for m in matrices],
        "Newton-Schulz float32": lambda: [scaled_newton_schulz(m, torch.float32) for m in matrices],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2, help="processes per node (FSDP shards)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--topk", type=int, default=32)
    args = parser.parse_args()

    shapes = [[-(-s[0] // args.shards), *s[1:]] for s in t5_small_shapes()]
    grads = [torch.randn(s) for s in shapes]
    phases = phase_functions(grads, args.chunk, args.topk)
    total = 0.0
    for name, fn in phases.items():
        ms = median_ms(fn, args.repeats)
        total += ms
        print(f"{name:22s} {ms:8.1f} ms")
    elements = sum(g.numel() for g in grads)
    print(f"{'total':22s} {total:8.1f} ms   ({elements / 1e6:.1f}M elements, {torch.get_num_threads()} thread(s))")


if __name__ == "__main__":
    main()
