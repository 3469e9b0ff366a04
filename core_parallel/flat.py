"""Flattening, padding and shard ranges: the pure arithmetic under ZeRO (no process groups here).

Every parameter is sharded on its own: its flat view (`numel` elements) is padded with zeros to
`padded_numel(numel, world) = world * shard_size(numel, world)` elements and split into `world` equal
pieces; rank `r` owns flat elements `[r * shard, (r + 1) * shard)`, of which `shard_range(numel, world, r)`
are real (the rest is padding). So any shape shards evenly, and the range a rank owns depends only on the
parameter's size and the world size, which is what makes checkpoints world-size independent.

Buckets group consecutive parameters (same dtype and device) up to a byte budget; a bucket's gradients are
packed as `[world, sum(shards)]` so one reduce-scatter hands every rank its shard of every parameter
(`pack_into`, `pack_for_reduce_scatter`), and one all-gather brings the updated shards back (`unpack_into`,
`unpack_gathered`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = [
    "intersect",
    "pack_for_reduce_scatter",
    "pack_into",
    "pad_flat",
    "padded_numel",
    "plan_buckets",
    "shard_range",
    "shard_size",
    "unpack_gathered",
    "unpack_into",
]


def shard_size(numel: int, world: int) -> int:
    """Elements each rank holds of a tensor with `numel` elements: ceil(numel / world)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return -(-numel // world)


def padded_numel(numel: int, world: int) -> int:
    """Length of the flat tensor after zero padding: a multiple of `world`, at least `numel`."""
    return shard_size(numel, world) * world


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The real (unpadded) flat range `[start, end)` that `rank` owns; empty when it owns only padding."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    shard = shard_size(numel, world)
    return min(rank * shard, numel), min((rank + 1) * shard, numel)


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Overlap of two half-open ranges, or None when they do not overlap."""
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def pad_flat(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """`tensor` flattened and zero padded to `padded_numel`: shape [world * shard]. A view when no padding."""
    flat = tensor.reshape(-1)
    pad = padded_numel(flat.numel(), world) - flat.numel()
    if pad == 0:
        return flat
    return torch.cat([flat, flat.new_zeros(pad)])


def plan_buckets(nbytes: Sequence[int], keys: Sequence[Hashable], cap_bytes: int) -> list[list[int]]:
    """Split items `0..n-1` (in the given order) into consecutive buckets of one key, at most `cap_bytes` each.

    An item larger than the cap gets a bucket of its own. Returns lists of item indices.
    """
    if len(nbytes) != len(keys):
        raise ValueError(f"nbytes and keys differ in length: {len(nbytes)} != {len(keys)}")
    if cap_bytes < 1:
        raise ValueError(f"cap_bytes must be >= 1, got {cap_bytes}")
    buckets: list[list[int]] = []
    size = 0
    for i, (n, key) in enumerate(zip(nbytes, keys)):
        if buckets and keys[buckets[-1][0]] == key and size + n <= cap_bytes:
            buckets[-1].append(i)
            size += n
        else:
            buckets.append([i])
            size = n
    return buckets


def pack_into(grid: torch.Tensor, offset: int, numel: int, flat_tensor: torch.Tensor | None, divisor: int = 1) -> None:
    """Write one 1-D tensor into columns `[offset, offset + shard)` of `grid` so row r holds its shard r.

    grid: [world, S] (values are cast to its dtype). flat_tensor: [numel], or None to write zeros. The
    padding after the last element is zeroed too, so stale values in a reused buffer never leak in.
    `divisor`: the values are divided by it on the way (one pass instead of two).
    """

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        if divisor == 1 or src.dtype != dst.dtype:
            dst.copy_(src)
            if divisor != 1:
                dst.div_(divisor)
        else:
            torch.div(src, divisor, out=dst)

    world = grid.shape[0]
    shard = shard_size(numel, world)
    if flat_tensor is None:
        grid[:, offset : offset + shard].zero_()
        return
    rows = numel // shard if shard else 0
    if rows:
        put(grid[:rows, offset : offset + shard], flat_tensor[: rows * shard].view(rows, shard))
    tail = numel - rows * shard
    if tail:
        put(grid[rows, offset : offset + tail], flat_tensor[rows * shard :])
        grid[rows, offset + tail : offset + shard].zero_()
        rows += 1
    if rows < world and shard:
        grid[rows:, offset : offset + shard].zero_()


def unpack_into(grid: torch.Tensor, offset: int, out: torch.Tensor) -> None:
    """Inverse of `pack_into`: copy the shards in columns `[offset, offset + shard)` of `grid` into `out` [numel]."""
    world = grid.shape[0]
    n = out.numel()
    shard = shard_size(n, world)
    rows = n // shard if shard else 0
    if rows:
        out[: rows * shard].view(rows, shard).copy_(grid[:rows, offset : offset + shard])
    if n > rows * shard:
        out[rows * shard :].copy_(grid[rows, offset : offset + n - rows * shard])


def pack_for_reduce_scatter(flats: Sequence[torch.Tensor], world: int) -> torch.Tensor:
    """Pack 1-D tensors so that rank r's shard of each one is contiguous in slot r.

    flats: 1-D tensors of any lengths (one dtype). Returns a new tensor [world * S], S = sum of their shard
    sizes, laid out as [world, S]: row r is the concatenation of shard r of every input (zero padded), in
    order. Each input is copied once, straight into place.
    """
    shards = [shard_size(f.numel(), world) for f in flats]
    total = sum(shards)
    out = flats[0].new_zeros(world * total)
    grid = out.view(world, total)
    offset = 0
    for f, shard in zip(flats, shards):
        pack_into(grid, offset, f.numel(), f)
        offset += shard
    return out


def unpack_gathered(gathered: torch.Tensor, numels: Sequence[int], world: int) -> list[torch.Tensor]:
    """Inverse of `pack_for_reduce_scatter`: split an all-gathered [world * S] buffer into flat tensors.

    gathered: [world * S] as produced by all-gathering each rank's concatenated shards.
    Returns one 1-D tensor of `numels[i]` elements per item (copies, padding dropped).
    """
    shards = [shard_size(n, world) for n in numels]
    total = sum(shards)
    if gathered.numel() != world * total:
        raise ValueError(f"gathered buffer has {gathered.numel()} elements, expected {world * total}")
    grid = gathered.view(world, total)
    out, offset = [], 0
    for n, s in zip(numels, shards):
        item = gathered.new_empty(n)
        unpack_into(grid, offset, item)
        out.append(item)
        offset += s
    return out
