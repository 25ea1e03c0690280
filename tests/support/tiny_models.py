"""Small models with awkward parameter shapes, and data that differs per replica and shard."""

from __future__ import annotations

import torch
import torch.nn as nn


class OddShapes(nn.Module):
    """Conv kernels (3-D, 4-D), a prime-row matrix, 1-element tensors: uneven and empty FSDP shards."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 5, 3)
        self.conv2 = nn.Conv2d(1, 6, 2)
        self.emb = nn.Parameter(torch.randn(17, 12) * 0.1)
        self.lin = nn.Linear(5 * 6 + 6 * 2 * 7 + 12, 33)
        self.out = nn.Linear(33, 1)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv1(x).flatten(1)
        b = self.conv2(x.unsqueeze(1)).flatten(1)
        c = x.flatten(1)[:, :17] @ self.emb
        h = torch.tanh(self.lin(torch.cat([a, b, c], 1)))
        return self.out(h).squeeze(-1) * self.scale


def batch(replica: int, shard: int, step: int, dtype=torch.float32, size: int = 16, dataset_batches: int = 4):
    """A regression batch that depends on (replica, shard, step): every process sees different data.

    Each process cycles through its own ``dataset_batches`` batches, so the loss can fall steadily.
    """
    g = torch.Generator().manual_seed(10_000 * replica + 1_000 * shard + step % dataset_batches)
    x = torch.randn(size, 3, 8, generator=g, dtype=dtype)
    y = (x.sum((1, 2)) * 0.5).sin() + 0.3 * x[:, 0, 0]
    return x, y
