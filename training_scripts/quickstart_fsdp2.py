"""FlexDeMo with plain PyTorch FSDP2: a byte-level language model on 2 nodes x 2 processes.

The smallest complete use of the optimizer without Accelerate or the Trainer. It trains on
the English text that ships with Python (``pydoc_data``), so it needs no download.

    # one machine, 2 simulated nodes x 2 processes (gloo on CPU):
    torchrun --standalone --nproc-per-node 4 training_scripts/quickstart_fsdp2.py

    # two real machines with 8 GPUs each (run on both; NODE_RANK 0 and 1):
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 \
        --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 \
        training_scripts/quickstart_fsdp2.py --nodes 2
"""

from __future__ import annotations

import argparse
import os
import pydoc_data.topics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from hf_flexdemo import CommStats, FlexDeMo
from hf_flexdemo.fsdp import shard_within_node


class ByteLM(nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def text_batches(rank: int, world: int, batch: int, context: int, seed: int):
    data = torch.frombuffer(bytearray(" ".join(pydoc_data.topics.topics.values()).encode()), dtype=torch.uint8)
    data = data.long()
    g = torch.Generator().manual_seed(seed * world + rank)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + context + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="replicas: the mesh's replicate dimension")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--scheme", default="demo")
    parser.add_argument("--topk", type=int, help="demo, sparseloco: coefficients per tile (default 32)")
    parser.add_argument("--chunk", type=int, help="demo, sparseloco: the tiles' side (default 64)")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = "cpu"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = "cuda"
    if world % args.nodes:
        raise ValueError(f"--nodes={args.nodes} does not divide the {world} processes")
    mesh = init_device_mesh(device, (args.nodes, world // args.nodes), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same initial model everywhere
    model = ByteLM().to(device)
    shard_within_node(model, mesh, blocks=model.blocks.layers)  # FSDP inside a node only: nothing crosses nodes
    # The default rule orthogonalizes each weight matrix's update; tables (token and position embeddings)
    # and the output head are no linear maps of the stream, so they take adam's rule instead.
    opt = FlexDeMo(
        model.parameters(),
        lr=args.lr,
        scheme=args.scheme,
        # Only what was given: a scheme that picks no top-k (full, diloco) refuses topk and chunk.
        **{key: value for key, value in (("topk", args.topk), ("chunk", args.chunk)) if value is not None},
        mesh=mesh,
        elementwise=[model.embed.weight, model.position, *model.head.parameters()],
    )

    batches = text_batches(rank, world, args.batch, 64, seed=1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, targets = (t.to(device) for t in next(batches))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"step {step:4d}  loss {mean_loss.item() / world:.3f}", flush=True)

    # Bytes that left each node: the sum over its processes (node 0 shown).
    totals = torch.tensor([opt.total_stats.bytes_sent, opt.total_stats.dense_bytes], dtype=torch.float64)
    dist.all_reduce(totals, group=mesh["shard"].get_group())
    if rank == 0:
        node = CommStats(bytes_sent=int(totals[0]), dense_bytes=int(totals[1]))
        print(
            f"\n{args.steps} steps in {time.perf_counter() - start:.1f}s on {args.nodes} nodes x "
            f"{world // args.nodes} processes, scheme={args.scheme}\n"
            f"inter-node bytes sent by node 0: {node.bytes_sent / 1e6:.2f} MB with FlexDeMo, "
            f"{node.dense_bytes / 1e6:.2f} MB with a dense bf16 gradient all-reduce "
            f"({node.x_fewer_than_bf16_dense:.0f}x fewer)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
