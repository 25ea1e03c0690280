"""How a tile-wise top-k selection travels: indices (16-bit, bit-packed or Elias-Fano) and values (low-bit or not).

Shared by the schemes that send each tile's ``k`` largest entries (``demo`` in the DCT
domain, ``sparseloco`` in the parameter's own): what a replica sends, what every receiver
decodes from it, and the sender's own copy of that decoded value, which is what error
feedback subtracts (so the rounding error stays behind, in the sender's accumulator).
"""

from __future__ import annotations

import torch

from ..compression import (
    ChunkPlan,
    EliasFano,
    dequantize_codes,
    dequantize_tiles,
    index_bits_for,
    pack_bits,
    quantize_codes,
    rounding_noise,
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
            codes, scale = quantize_codes(values, bits, noise=self.noise(values.shape, values.device, generator))
            return self.pack(indices, None, codes, scale, plan, value_dtype), dequantize_codes(codes, scale, bits)
        sent = self.pack(indices, values, None, None, plan, value_dtype)
        return sent, sent[-1]  # the values, after the indices

    def noise(self, shape: tuple[int, ...], device: torch.device, generator=None) -> torch.Tensor | None:
        """Stochastic rounding's draws for ``(n_tiles, k)`` values, uniform in [0, 1); None when rounding to nearest."""
        return rounding_noise(self.config.value_bits, self.config.rounding, shape, device, generator)

    def pack(
        self,
        indices: torch.Tensor,
        values: torch.Tensor | None,
        codes: torch.Tensor | None,
        scale: torch.Tensor | None,
        plan: ChunkPlan,
        value_dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """What travels for a selection: indices, then ``values`` in ``value_dtype`` or (``value_bits`` > 0) the
        unpacked ``codes`` packed and their ``scale``."""
        bits = self.config.value_bits
        sent = [pack_bits(codes, bits), scale] if bits else [values.to(value_dtype)]
        if self.config.index_coding == "elias_fano":
            return [*EliasFano(plan.k, plan.tile_size).encode(indices), *sent]
        if self.config.pack_indices:
            return [pack_bits(indices, index_bits_for(plan.tile_size)), *sent]
        return [indices.to(plan.index_dtype), *sent]

    def read(self, part: list[torch.Tensor], plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """One replica's ``(indices, values)`` back from what it sent."""
        if self.config.index_coding == "elias_fano":
            lows, vector, *sent = part
            indices = EliasFano(plan.k, plan.tile_size).decode(lows, vector, plan.n_tiles)
        elif self.config.pack_indices:
            packed, *sent = part
            bits = index_bits_for(plan.tile_size)
            indices = unpack_bits(packed, bits, plan.n_tiles * plan.k).view(plan.n_tiles, plan.k)
        else:
            indices, *sent = part
        if self.config.value_bits:
            codes, scale = sent
            return indices, dequantize_tiles(codes, scale, self.config.value_bits, plan.k)
        return indices, sent[0]
