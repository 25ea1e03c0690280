"""Optimizer step time and inter-node bytes on T5-small's parameter shapes (60.5M parameters).

    # one process: optimizer compute only
    python benchmarks/step/optimizer_step.py
    # two replicas (one process each, gloo on loopback): adds the real exchange
    torchrun --standalone --nproc-per-node 2 benchmarks/step/optimizer_step.py
    # one node of two processes, every tensor a row-sharded FSDP2 DTensor: the update rules' in-node work
    torchrun --standalone --nproc-per-node 2 benchmarks/step/optimizer_step.py --shard_processes 2

The AdamW baseline with replicas also all-reduces the gradients (what HSDP does between
nodes). Times are medians over ``--repeats`` runs of ``--steps`` steps, after one warm-up
run; DiLoCo uses H = ``--steps``, so each run holds one outer step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from transformers import T5Config

from hf_flexdemo import FlexDeMo, FlexDeMoConfig
from hf_flexdemo.wire import ring_all_reduce_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared harness

from harness import t5_small_shapes  # noqa: E402

CONFIGS = {  # the figures in BENCHMARKS.md took sign steps (the default then): those configurations name it
    "adamw": None,
    "flexdemo demo": dict(scheme="demo", update="sign"),
    "flexdemo demo bf16 values": dict(scheme="demo", value_dtype="bf16", update="sign"),
    "flexdemo demo packed indices": dict(scheme="demo", pack_indices=True, update="sign"),
    "flexdemo demo bf16 + packed": dict(scheme="demo", value_dtype="bf16", pack_indices=True, update="sign"),
    "flexdemo demo 4-bit + packed": dict(scheme="demo", value_bits=4, pack_indices=True, update="sign"),
    "flexdemo demo 1-bit + packed": dict(scheme="demo", value_bits=1, pack_indices=True, update="sign"),
    "flexdemo demo top-4 1-bit + packed": dict(scheme="demo", topk=4, value_bits=1, pack_indices=True, update="sign"),
    "flexdemo random": dict(scheme="random", update="sign"),
    "flexdemo striding": dict(scheme="striding", update="sign"),
    "flexdemo diloco (H=--steps)": dict(scheme="diloco"),
    "flexdemo sparseloco top-64 2-bit + packed (H=--steps)": dict(
        scheme="sparseloco", topk=64, value_bits=2, pack_indices=True
    ),
    "flexdemo full": dict(scheme="full", update="sign"),
    # Update rules (hf_flexdemo.updates); orthogonal leaves the embedding to the element-wise rule, as the Trainer does.
    "flexdemo demo update=adam": dict(scheme="demo", update="adam"),
    "flexdemo demo orthogonal + adam": dict(scheme="demo", update="orthogonal"),
}
VOCAB = T5Config().vocab_size


def run_config(name, kwargs, shapes, mesh, steps, repeats, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    shard_mesh = mesh["shard"] if mesh is not None and mesh["shard"].size() > 1 else None
    if shard_mesh is not None:  # FSDP2's layout: every tensor's rows split among the node's processes
        full = [distribute_tensor(t, shard_mesh, [Shard(0)]) for t in full]
        grads = [distribute_tensor(t, shard_mesh, [Shard(0)]) for t in grads]
    params = [torch.nn.Parameter(t) for t in full]
    replicas = mesh["replicate"].size() if mesh is not None else 1
    if kwargs is None:
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        # DiLoCo: one outer step per timed run of `steps`, so time and bytes are amortized over H.
        extra = {"inner_steps": steps} if kwargs.get("scheme") in ("diloco", "sparseloco") else {}
        if FlexDeMoConfig(**kwargs).update == "orthogonal":
            extra["elementwise"] = [p for p in params if p.shape[0] == VOCAB]  # the shared embedding and the head
        opt = FlexDeMo(params, lr=1e-4, mesh=mesh, **kwargs, **extra)

    def step():
        for p, grad in zip(params, grads):
            p.grad = grad.clone() if kwargs is None else grad
        if kwargs is None and replicas > 1:
            for p in params:  # HSDP's inter-node gradient all-reduce
                dist.all_reduce(p.grad.to_local() if shard_mesh else p.grad, group=mesh["replicate"].get_group())
        opt.step()

    for _ in range(steps):  # warm-up: one run
        step()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps)
    local = [g.to_local() if shard_mesh is not None else g for g in grads]  # what this process all-reduces
    grad_bytes = sum(g.numel() * g.element_size() for g in local)
    dense = ring_all_reduce_bytes(grad_bytes, max(replicas, 2))
    if kwargs is None:
        sent = dense if replicas > 1 else None
    else:
        sent = (opt.total_stats.bytes_sent / (steps * (repeats + 1))) if replicas > 1 else None
    return {"name": name, "step_s": statistics.median(times), "runs": times, "bytes_sent": sent, "dense_bytes": dense}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="config names to run (default: all)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument(
        "--shard_processes", type=int, default=1, help="processes per node (replica), each holding row shards"
    )
    args = parser.parse_args()

    mesh = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        if world % args.shard_processes:
            raise SystemExit(f"--shard_processes={args.shard_processes} must divide the {world} processes")
        layout = (world // args.shard_processes, args.shard_processes)
        mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    shapes = t5_small_shapes()
    n_params = sum(torch.Size(s).numel() for s in shapes)
    results = []
    for name, kwargs in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        results.append(run_config(name, kwargs, shapes, mesh, args.steps, args.repeats))
        if rank == 0:
            r = results[-1]
            sent = f"{r['bytes_sent'] / 1e6:9.2f} MB" if r["bytes_sent"] is not None else "        n/a"
            ratio = f"{r['dense_bytes'] / r['bytes_sent']:7.1f}x" if r["bytes_sent"] else "     n/a"
            print(f"{r['name']:28s} step {r['step_s'] * 1e3:8.1f} ms   sent/step {sent}   vs dense {ratio}", flush=True)
    if rank == 0:
        replicas = mesh["replicate"].size() if mesh is not None else 1
        print(
            f"\n{n_params / 1e6:.1f}M parameters (T5-small shapes), {replicas} replica(s) of "
            f"{args.shard_processes} process(es), "
            f"{torch.get_num_threads()} threads per process"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"params": n_params, "replicas": replicas, "results": results}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
