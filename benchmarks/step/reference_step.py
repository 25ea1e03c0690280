"""The reference implementation's DeMo step (PyPI ``detonation`` 0.5.2) on T5-small's shapes.

The reference is not a dependency; install it beside the project, not into the venv:

    .venv/bin/pip download detonation==0.5.2 einops mltiming --no-deps -d /tmp/det_pkg
    .venv/bin/pip install --no-deps --target /tmp/det_site /tmp/det_pkg/*
    PYTHONPATH=/tmp/det_site .venv/bin/python benchmarks/step/reference_step.py --force-compress
    PYTHONPATH=/tmp/det_site OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/step/reference_step.py

Each process is one replica with plain parameters (its own sharding group of one, so the
reference does not reduce-scatter). With one replica the reference skips compression
altogether; ``--force-compress`` makes its ``world_size == 1`` test fail so that its own
compress, gather and decode code runs, which is what ``optimizer_step.py`` measures for us.
Same protocol as ``optimizer_step.py``: medians of ``--repeats`` runs of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from detonation.optim.demo import DeMo  # not re-exported by detonation/__init__

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness

from harness import t5_small_shapes  # noqa: E402


class _OneThatIsNotOne(int):
    """An int 1 for which ``== 1`` is False: defeats the reference's one-replica shortcut."""

    def __eq__(self, other):
        return False if other == 1 else int(self) == other

    __hash__ = int.__hash__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--force-compress", action="store_true")
    args = parser.parse_args()

    if "WORLD_SIZE" not in os.environ:  # one process: a gloo group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard_group = [dist.new_group([r]) for r in range(world)][rank]
    replicate_group = dist.new_group(list(range(world)))

    g = torch.Generator().manual_seed(0)
    shapes = t5_small_shapes()
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    opt = DeMo(
        params,
        compression_decay=0.999,
        compression_topk=32,
        compression_chunk=64,
        lr=1e-4,
        detonation_sign=True,
        sharding_parallel_group=shard_group,
        replication_parallel_group=replicate_group,
    )
    replicator = opt.replicators[0]
    if args.force_compress and world == 1:
        replicator._replication_world_size = _OneThatIsNotOne(1)

    def step():
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()

    for _ in range(args.steps):  # warm-up: one run
        step()
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        times.append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        print(
            f"reference DeMo, {world} replica(s){' (forced compression)' if args.force_compress else ''}: "
            f"step {statistics.median(times) * 1e3:.1f} ms (runs {[round(t * 1e3) for t in times]}), "
            f"sent/step {replicator.data_transmitted[-1] / 1e6:.2f} MB (its own counter)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
