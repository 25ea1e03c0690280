"""The tensor maths of DeMo: tiling, DCT, top-k, decoding. No processes, no optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from hf_flexdemo.compression import (
    ChunkPlan,
    EliasFano,
    dct_matrix,
    decode_replicas,
    dequantize_tiles,
    flat_positions,
    from_coefficients,
    index_bits_for,
    index_dtype_for,
    largest_divisor_at_most,
    pack_bits,
    packed_nbytes,
    quantize_tiles,
    scaled_topk,
    select_topk,
    tiles,
    to_coefficients,
    unpack_bits,
)

pytestmark = pytest.mark.unit

SHAPES = [(), (1,), (7,), (64,), (130,), (100, 30), (17, 12), (5, 3, 3), (6, 1, 2, 2), (2, 3, 4, 5), (1, 33)]


def test_largest_divisor():
    assert [largest_divisor_at_most(n, 64) for n in (1, 7, 64, 130, 4096, 32128, 251)] == [1, 7, 64, 26, 64, 64, 1]


@pytest.mark.parametrize("shape", SHAPES)
def test_plan_tiles_every_shape_exactly(shape):
    plan = ChunkPlan.for_shape(shape, chunk=8, topk=4)
    numel = math.prod(shape)
    assert plan.rows * plan.cols == numel
    assert plan.rows % plan.tile_rows == 0 and plan.cols % plan.tile_cols == 0
    assert plan.tile_rows <= 8 and plan.tile_cols <= 8
    assert plan.n_tiles * plan.tile_size == numel
    assert plan.k == min(4, plan.tile_size)


@pytest.mark.parametrize(
    "shape, k",
    [
        ((128, 128), 128),
        ((64, 128), 64),
        ((32, 4), 1),
        ((128,), 1),
        ((100, 384), 100),
        ((100, 100), 78),
        ((3, 64), 2),
        ((5, 64), 3),
        ((4, 4), 1),
        ((96, 256), 96),
    ],
)
def test_scaled_topk_keeps_topks_share_of_a_full_tile(shape, k):
    """``scale_topk``: top 128 of a 128 x 128 tile is 1 in 128, and a smaller tile keeps that share, rounded half up
    (2.5 of (5, 64) to 3, where Python's round gives 2), at least 1; unscaled, every tile keeps 128 (at most itself)."""
    plan = ChunkPlan.for_shape(shape, chunk=128, topk=128, scale_topk=True)
    assert plan.k == k == scaled_topk(128, plan.tile_size, 128)
    assert ChunkPlan.for_shape(shape, chunk=128, topk=128).k == min(128, plan.tile_size)


def test_plan_for_empty_shard():
    plan = ChunkPlan.for_shape((0, 12), chunk=8, topk=4)
    assert plan.n_tiles == 0


def test_dct_matrix_is_orthonormal_and_puts_a_constant_in_the_first_coefficient():
    for n in (1, 2, 7, 64):
        c = dct_matrix(n, torch.float64, torch.device("cpu"))
        torch.testing.assert_close(c @ c.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
        coeffs = c @ torch.full((n,), 3.0, dtype=torch.float64)
        assert coeffs[0].item() == pytest.approx(3.0 * math.sqrt(n))
        if n > 1:
            assert coeffs[1:].abs().max().item() < 1e-12


@pytest.mark.parametrize("shape", SHAPES)
def test_dct_round_trip_is_exact_when_k_is_the_whole_tile(shape):
    x = torch.randn(shape, dtype=torch.float64)
    plan = ChunkPlan.for_shape(x.shape, chunk=8, topk=64)
    coefficients = to_coefficients(x, plan)
    indices, values = select_topk(coefficients, plan)
    assert indices.shape == (plan.n_tiles, plan.tile_size)
    dense = decode_replicas([(indices, values)], plan, "selected", torch.float64)
    torch.testing.assert_close(from_coefficients(dense, plan).reshape(x.shape), x, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(16, 24), (12, 7), (9,)])
def test_coefficient_matrix_matches_a_per_tile_dct(shape):
    x = torch.randn(shape, dtype=torch.float64)
    plan = ChunkPlan.for_shape(x.shape, chunk=4, topk=2)
    matrix = x.reshape(plan.rows, plan.cols)
    left = dct_matrix(plan.tile_rows, torch.float64, torch.device("cpu"))
    right = dct_matrix(plan.tile_cols, torch.float64, torch.device("cpu"))
    coefficients = to_coefficients(x, plan)
    for r in range(0, plan.rows, plan.tile_rows):
        for c in range(0, plan.cols, plan.tile_cols):
            tile = matrix[r : r + plan.tile_rows, c : c + plan.tile_cols]
            expected = left @ tile @ right.T
            torch.testing.assert_close(coefficients[r : r + plan.tile_rows, c : c + plan.tile_cols], expected)


def test_topk_keeps_the_largest_magnitudes_of_each_tile():
    coefficients = torch.tensor([[0.1, -5.0, 3.0, 0.2, 1.0, 2.0, -3.0, 4.0]])
    plan = ChunkPlan.for_shape((8,), chunk=4, topk=2)
    indices, values = select_topk(coefficients, plan)
    assert [sorted(row) for row in indices.tolist()] == [[1, 2], [2, 3]]
    assert torch.equal(values, tiles(coefficients, plan).gather(1, indices))
    assert sorted(flat_positions(indices, plan).tolist()) == [1, 2, 6, 7]


@pytest.mark.parametrize("value_bits", [0, 1, 4])
def test_error_feedback_removes_exactly_what_receivers_decode_from_the_momentum(value_bits):
    """One DeMo step: the stored momentum is lr*DCT(grad) minus the sent coefficients as decoded."""
    from hf_flexdemo import FlexDeMo

    p = torch.nn.Parameter(torch.zeros(40, 24, dtype=torch.float64))
    p.grad = torch.randn(40, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    opt = FlexDeMo([p], lr=0.1, topk=5, chunk=8, scheme="demo", value_bits=value_bits)
    opt.step()
    plan = ChunkPlan.for_shape(p.shape, chunk=8, topk=5)
    coefficients = to_coefficients(p.grad, plan) * 0.1  # as the optimizer computes it: lr * DCT(grad)
    indices, values = select_topk(coefficients, plan)
    if value_bits:
        values = dequantize_tiles(*quantize_tiles(values, value_bits), value_bits, plan.k).double()
    before = tiles(coefficients, plan)
    expected = before.clone().scatter_(1, indices, before.gather(1, indices) - values)
    kept = tiles(opt.state[p]["momentum_dct"], plan)
    torch.testing.assert_close(kept, expected, atol=1e-15, rtol=0)
    if not value_bits:
        assert kept.gather(1, indices).abs().max() == 0  # nothing sent stays behind
    # Nothing unsent was touched.
    untouched = torch.ones_like(before, dtype=torch.bool).scatter_(1, indices, False)
    assert torch.equal(kept[untouched], before[untouched])


@pytest.mark.parametrize("tile_size", [1, 2, 3, 64, 256, 4096, 4097, 2**16])
def test_bit_packing_round_trips_at_the_width_a_tile_needs(tile_size):
    bits = index_bits_for(tile_size)
    assert 2 ** (bits - 1) < tile_size <= 2**bits or tile_size == 1
    values = torch.randint(0, tile_size, (37,), generator=torch.Generator().manual_seed(tile_size))
    values[0] = tile_size - 1  # the largest position fits
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(37, bits) == -(-37 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 37), values)


@pytest.mark.parametrize(
    ("tile_size", "k"), [(4096, 32), (4096, 24), (4096, 96), (4096, 1), (4096, 4096), (4095, 4094), (63, 7), (1, 1)]
)
def test_elias_fano_indices_round_trip_in_at_most_2_plus_log2_of_tile_over_k_bits_each(tile_size, k):
    code = EliasFano(k, tile_size)
    g = torch.Generator().manual_seed(tile_size + k)
    indices = torch.stack([torch.randperm(tile_size, generator=g)[:k].sort().values for _ in range(37)])
    indices[0] = torch.arange(tile_size - k, tile_size)  # the last positions: the highest bits of the vector
    indices[1] = torch.arange(k)
    streams = code.encode(indices)
    assert all(s.dtype == torch.uint8 for s in streams)
    assert sum(s.numel() for s in streams) == packed_nbytes(37 * k, code.low_bits) + packed_nbytes(37, code.vector_bits)
    assert code.bits_per_tile <= k * (2 + math.log2(tile_size / k))
    assert torch.equal(code.decode(*streams, 37), indices)


def test_elias_fano_sends_32_of_4096_positions_in_9_bits_each_and_96_in_7_and_a_third():
    assert EliasFano(32, 4096).bits_per_tile == 32 * 9  # fixed width: 12
    assert EliasFano(96, 4096).bits_per_tile == 96 * 7 + 32


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_low_bit_values_read_back_within_their_step(bits):
    values = torch.randn(6, 32, generator=torch.Generator().manual_seed(bits)) * torch.arange(1, 7).view(6, 1)
    codes, scale = quantize_tiles(values, bits)
    assert codes.dtype == torch.uint8 and codes.numel() == packed_nbytes(6 * 32, bits) and scale.shape == (6,)
    decoded = dequantize_tiles(codes, scale, bits, 32)
    if bits == 1:  # the sign, at the tile's mean magnitude
        expected = torch.where(values >= 0, 1.0, -1.0) * values.abs().mean(1, keepdim=True)
        assert torch.equal(decoded, expected)
    else:  # round to nearest: within half a step of the tile's scale
        assert ((decoded - values).abs() <= scale.view(6, 1) / 2 + 1e-6).all()
        assert torch.equal(decoded.abs().amax(1), values.abs().amax(1))  # the largest is exact
    assert torch.equal(dequantize_tiles(*quantize_tiles(torch.zeros(2, 8), bits), bits, 8), torch.zeros(2, 8))


def test_index_dtype_is_the_smallest_that_holds_a_tile_position():
    assert index_dtype_for(64) == torch.uint8
    assert index_dtype_for(256) == torch.uint8
    assert index_dtype_for(64 * 64) == torch.uint16
    assert index_dtype_for(2**16) == torch.uint16
    assert index_dtype_for(2**16 + 1) == torch.int32
    assert ChunkPlan.for_shape((128, 128), chunk=64, topk=32).index_dtype == torch.uint16


def test_decoding_selected_averages_over_the_replicas_that_picked_a_coefficient():
    plan = ChunkPlan.for_shape((4,), chunk=4, topk=2)
    a = (torch.tensor([[0, 1]]), torch.tensor([[2.0, 4.0]]))
    b = (torch.tensor([[1, 3]]), torch.tensor([[6.0, 8.0]]))
    selected = decode_replicas([a, b], plan, "selected", torch.float64)
    mean = decode_replicas([a, b], plan, "mean", torch.float64)
    assert selected.tolist() == [[2.0, 5.0, 0.0, 8.0]]
    assert mean.tolist() == [[1.0, 5.0, 0.0, 4.0]]


@pytest.mark.parametrize("shape", [(128, 192), (7, 64), (64, 5)])
def test_the_inverse_dct_written_over_its_input_gives_the_same_bits(shape):
    plan = ChunkPlan.for_shape(shape, chunk=64, topk=8)
    coefficients = to_coefficients(torch.randn(shape, generator=torch.Generator().manual_seed(1)), plan)
    expected = from_coefficients(coefficients, plan)
    scratch = coefficients.clone()
    assert torch.equal(from_coefficients(scratch, plan, overwrite=True), expected)


def test_decoding_adds_replicas_in_rank_order_so_every_process_gets_the_same_bits():
    """float32 addition is not associative: only a fixed order makes every replica's decode identical.

    The decode must equal a plain left-to-right sum in replica order, and that sum must differ
    from the reverse order somewhere, or this test could not see an order change.
    """
    plan = ChunkPlan.for_shape((64, 64), chunk=64, topk=512)
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(64, 64, generator=generator) * 10**i for i in range(6)]
    parts = [select_topk(to_coefficients(m, plan), plan) for m in matrices]

    def in_order(order):
        total, count = torch.zeros(plan.rows * plan.cols), torch.zeros(plan.rows * plan.cols)
        for indices, values in (parts[i] for i in order):
            where = flat_positions(indices, plan)
            total[where] += values.reshape(-1)
            count[where] += 1
        return (total / count.clamp(min=1)).view(plan.rows, plan.cols)

    forward = in_order(range(len(parts)))
    assert not torch.equal(forward, in_order(reversed(range(len(parts)))))
    assert torch.equal(decode_replicas(parts, plan, "selected", torch.float32), forward)


def test_16_bit_inputs_are_transformed_in_float32():
    x = torch.randn(16, 16).to(torch.bfloat16)
    plan = ChunkPlan.for_shape(x.shape, chunk=8, topk=4)
    assert to_coefficients(x, plan).dtype == torch.float32


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    from hf_flexdemo.compression import dequantize_tiles, quantize_tiles

    values = torch.tensor([[1.0, 0.3, -0.3, 0.1]])  # scale 1.0 at 2 bits: codes -1, 0, 1
    nearest = dequantize_tiles(*quantize_tiles(values, 2), 2, 4)
    assert nearest.tolist() == [[1.0, 0.0, 0.0, 0.0]]  # small values always vanish
    g = torch.Generator().manual_seed(0)
    draws = [
        dequantize_tiles(*quantize_tiles(values, 2, noise=torch.rand(1, 4, generator=g)), 2, 4) for _ in range(4000)
    ]
    mean = torch.stack(draws).mean(0)
    torch.testing.assert_close(mean, values, rtol=0, atol=0.03)
