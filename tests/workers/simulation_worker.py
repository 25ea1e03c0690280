"""R gloo nodes of one process each, trained on the micro-batches that ``simulate_replicas=R`` gives its replicas.

Run by tests/test_simulated_replicas.py through torchrun (R processes); every rank saves its parameters,
optimizer state and last step's bytes for each configuration, and the test compares them with one process
that simulates the R replicas. Both sides train with :func:`train`, so they differ only in how the replicas meet.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from support.tiny_models import OddShapes, batch
from torch.distributed.device_mesh import init_device_mesh

from hf_flexdemo import FlexDeMo
from hf_flexdemo.dtensor_utils import local_tensor

STEPS = 6
SMALL = dict(topk=4, chunk=8)  # several tiles per matrix at these shapes
CONFIGS = {
    f"{update}_{wire}": dict(SMALL if wire == "demo" else {"wire": wire}, update=rule, elementwise_update=elementwise)
    for update, (rule, elementwise) in {"sign": ("sign", None), "default": (None, None)}.items()
    for wire in ("demo", "2bit", "top128_4bit")
}
"""The sign rule and the default rule, on DeMo's wire and the two compressed presets the issue names (``2bit``
codes its indices in Elias-Fano). The presets keep their own top-k on the default 64 x 64 tiles."""
CONFIGS["default_scaled"] = dict(
    SMALL, topk=16, scale_topk=True, value_bits=2, pack_indices=True, index_coding="elias_fano"
)
"""The default rule with a smaller tile keeping its share of the top 16 of 8 x 8 (``scale_topk``)."""


def train(name: str, replicas: int, rank: int | None, mesh=None) -> dict:
    """Train configuration ``name``; ``rank`` None: simulate all ``replicas`` in this process, else be node ``rank``.

    Returns the parameters, the optimizer state (a node's per-replica entries as their local ``(1, *shape)``) and the last step's bytes sent (node 0's when simulating).
    """
    torch.manual_seed(0)
    model = OddShapes()
    config = {k: v for k, v in CONFIGS[name].items() if v is not None}
    simulated = {"simulate_replicas": replicas} if rank is None else {}
    opt = FlexDeMo(model.parameters(), lr=0.01, mesh=mesh, elementwise=[model.out.weight], **config, **simulated)
    for step in range(STEPS):
        for replica in range(replicas) if rank is None else (rank,):
            x, y = batch(replica, 0, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if rank is None and replica < replicas - 1:
                opt.next_replica()
        opt.step()
        opt.zero_grad()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": [{k: local_tensor(v).clone() for k, v in opt.state[p].items()} for p in model.parameters()],
        "bytes_sent": opt.last_step_stats.bytes_sent,
    }


def adamw(replicas: int, rank: int | None) -> list[torch.Tensor]:
    """AdamW on the replicas' mean gradient: all-reduced across nodes (HSDP), or accumulated in one process."""
    torch.manual_seed(0)
    model = OddShapes()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        for replica in range(replicas) if rank is None else (rank,):
            x, y = batch(replica, 0, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / replicas if rank is None else loss).backward()  # the Trainer's accumulation divides so
        if rank is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(replicas)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def refusal_with_a_real_group(mesh) -> str:
    """The message of a simulation asked for inside a real replicate group ('' if it trained)."""
    model = OddShapes()
    opt = FlexDeMo(model.parameters(), lr=0.01, mesh=mesh, simulate_replicas=2, elementwise=[])
    for _ in range(2):
        torch.nn.functional.mse_loss(model(batch(0, 0, 0)[0]), batch(0, 0, 0)[1]).backward()
        opt.next_replica()
    try:
        opt.step()
    except ValueError as error:
        return str(error)
    return ""


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, replicas = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (replicas,), mesh_dim_names=("replicate",))
    results = {name: train(name, replicas, rank, mesh) for name in CONFIGS}
    results["adamw"] = adamw(replicas, rank)
    results["refused"] = refusal_with_a_real_group(mesh)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
