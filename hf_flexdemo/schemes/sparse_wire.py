"""How a tile-wise top-k selection travels: indices (16-bit or bit-packed) and values (low-bit or not).

Shared by the schemes that send each tile's ``k`` largest entries (``demo`` in the DCT
domain, ``sparseloco`` in the parameter's own): what a replica sends, what every receiver
decodes from it, and the sender's own copy of that decoded value, which is what error
feedback subtracts (so the rounding error stays behind, in the sender's accumulator).
"""

from __future__ import annotations

import torch

from ..compression import (
    ChunkPlan,
    dequantize_tiles,
    index_bits_for,
    pack_bits,
    quantize_tiles,
    unpack_bits,
)
from ..config import FlexDeMoConfig


class TopKWire:
    """Encode and decode one replica's ``(indices, values)`` of shape ``(n_tiles, k)``."""

    def __init__(self, config: FlexDeMoConfig):
        self.config = config

    def encode(
        self, indices: torch.Tensor, values: torch.Tensor, plan: ChunkPlan, value_dtype: torch.dtype, generator=None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What travels, and the values every receiver will read back."""
        bits = self.config.value_bits
        if bits:
            noise = None
            if self.config.rounding == "stochastic":
                noise = torch.rand(values.shape, generator=generator, dtype=torch.float32).to(values.device)
            codes, scale = quantize_tiles(values, bits, noise=noise)
            sent = [codes, scale]
            decoded = dequantize_tiles(codes, scale, bits, plan.k)
        else:
            sent = [values.to(value_dtype)]
            decoded = sent[0]
        if self.config.pack_indices:
            return [pack_bits(indices, index_bits_for(plan.tile_size)), *sent], decoded
        return [indices.to(plan.index_dtype), *sent], decoded

    def read(self, part: list[torch.Tensor], plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """One replica's ``(indices, values)`` back from what it sent."""
        indices, *sent = part
        if self.config.pack_indices:
            count = plan.n_tiles * plan.k
            indices = unpack_bits(indices, index_bits_for(plan.tile_size), count).view(plan.n_tiles, plan.k)
        if self.config.value_bits:
            codes, scale = sent
            return indices, dequantize_tiles(codes, scale, self.config.value_bits, plan.k)
        return indices, sent[0]
