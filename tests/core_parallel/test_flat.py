"""Pure shard arithmetic: ranges cover every element once, packing round-trips, buckets respect the cap."""

from __future__ import annotations

import pytest
import torch

from lowmem.core_parallel import flat


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 13, 64, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ranges_partition_the_tensor(numel, world):
    shard = flat.shard_size(numel, world)
    assert flat.padded_numel(numel, world) == shard * world >= numel
    assert flat.padded_numel(numel, world) - numel < world
    covered = []
    for rank in range(world):
        start, end = flat.shard_range(numel, world, rank)
        assert 0 <= start <= end <= numel and end - start <= shard
        covered.extend(range(start, end))
    assert covered == list(range(numel))


def test_bad_arguments():
    with pytest.raises(ValueError, match="world"):
        flat.shard_size(3, 0)
    with pytest.raises(ValueError, match="rank"):
        flat.shard_range(3, 2, 2)
    with pytest.raises(ValueError, match="cap_bytes"):
        flat.plan_buckets([1], ["a"], 0)


def test_pack_then_unpack_round_trips_and_rows_are_shards():
    world = 3
    tensors = [torch.randn(5, 3), torch.randn(1), torch.randn(4)]
    flats = [t.reshape(-1) for t in tensors]
    packed = flat.pack_for_reduce_scatter(flats, world)
    grid = packed.view(world, -1)
    for rank in range(world):
        offset = 0
        for f in flats:
            start, end = flat.shard_range(f.numel(), world, rank)
            shard = flat.shard_size(f.numel(), world)
            torch.testing.assert_close(grid[rank, offset : offset + end - start], f[start:end], rtol=0, atol=0)
            assert bool((grid[rank, offset + end - start : offset + shard] == 0).all())  # padding is zero
            offset += shard
    for f, back in zip(flats, flat.unpack_gathered(packed, [f.numel() for f in flats], world)):
        torch.testing.assert_close(back, f, rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected"):
        flat.unpack_gathered(packed[:-1], [f.numel() for f in flats], world)


def test_reduce_scatter_arithmetic_matches_float64_sum():
    """Summing the packed rows of several 'ranks' and taking row r gives rank r's shard of the sum."""
    world = 4
    sizes = [7, 1, 10]
    gen = torch.Generator().manual_seed(0)
    per_rank = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(world)]
    packed = torch.stack([flat.pack_for_reduce_scatter(g, world) for g in per_rank]).sum(0).view(world, -1)
    ref = [sum(g[i].double() for g in per_rank) for i in range(len(sizes))]
    # float32 summation of `world` terms: error at most (world - 1) * eps * sum(|terms|)
    bound = [(world - 1) * torch.finfo(torch.float32).eps * sum(g[i].double().abs() for g in per_rank)
             for i in range(len(sizes))]
    for rank in range(world):
        offset = 0
        for i, n in enumerate(sizes):
            start, end = flat.shard_range(n, world, rank)
            err = (packed[rank, offset : offset + end - start].double() - ref[i][start:end]).abs()
            assert bool((err <= bound[i][start:end]).all()), f"rank {rank} item {i}: error {err.max():.3e}"
            offset += flat.shard_size(n, world)


def test_buckets_are_consecutive_single_key_and_capped():
    nbytes = [40, 40, 100, 10, 10, 10, 30]
    keys = ["f32", "f32", "f32", "f16", "f16", "f32", "f32"]
    buckets = flat.plan_buckets(nbytes, keys, cap_bytes=50)
    assert [i for b in buckets for i in b] == list(range(len(nbytes)))
    for b in buckets:
        assert len({keys[i] for i in b}) == 1
        assert sum(nbytes[i] for i in b) <= 50 or len(b) == 1
    assert buckets == [[0], [1], [2], [3, 4], [5, 6]]


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("divisor", [1, 4])
def test_pack_into_reused_buffer_and_unpack_into(world, divisor):
    """Packing into a dirty buffer leaves no stale values (padding, missing tensors), divides on the way."""
    numels = [7, 1, 12, 0, 5]
    gen = torch.Generator().manual_seed(1)
    flats = [torch.randn(n, generator=gen) for n in numels]
    width = sum(flat.shard_size(n, world) for n in numels)
    grid = torch.full((world, width), float("nan"))
    offset = 0
    for i, (n, f) in enumerate(zip(numels, flats)):
        flat.pack_into(grid, offset, n, None if i == 2 else f, divisor)
        offset += flat.shard_size(n, world)
    expected = flat.pack_for_reduce_scatter([f / divisor if i != 2 else torch.zeros(12) for i, f in enumerate(flats)],
                                            world)
    torch.testing.assert_close(grid.reshape(-1), expected, rtol=0, atol=0)
    offset = 0
    for i, (n, f) in enumerate(zip(numels, flats)):
        out = torch.empty(n)
        flat.unpack_into(grid, offset, out)
        torch.testing.assert_close(out, torch.zeros(n) if i == 2 else f / divisor, rtol=0, atol=0)
        offset += flat.shard_size(n, world)


def test_intersect():
    assert flat.intersect((0, 5), (3, 9)) == (3, 5)
    assert flat.intersect((0, 5), (5, 9)) is None
