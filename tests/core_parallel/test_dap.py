"""DAP primitives: forward values and gradients against the unsplit computation in float64.

Gradient convention under test: the differentiated loss is the sum of every rank's loss, so gradients of
replicated tensors are partial and are summed over the group before comparing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowmem.core_parallel import Axis, Topology, run_on_ranks
from lowmem.core_parallel.dap import (
    all_reduce_grads,
    all_to_all,
    all_to_all_async,
    gather,
    gather_async,
    scatter,
    shard_range,
    shard_size,
)

F64 = dict(dtype=torch.float64)


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **F64)


def _shard(x: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    start, stop = shard_range(x.size(dim), world, rank)
    return x.narrow(dim, start, stop - start)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def test_shard_ranges_partition_any_length():
    for world in (1, 2, 3, 4, 7):
        for length in (0, 1, 3, 5, 37, 64):
            ranges = [shard_range(length, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if length:
                assert max(shard_size(length, world, r) for r in range(world)) == -(-length // world)
    assert [shard_size(37, 4, r) for r in range(4)] == [10, 10, 10, 7]
    assert [shard_size(3, 4, r) for r in range(4)] == [1, 1, 1, 0]
    with pytest.raises(ValueError):
        shard_range(5, 2, 2)


def test_no_group_is_identity():
    x = _rand(0, 3, 4).requires_grad_()
    assert scatter(x, 0, None) is x
    assert gather(x, 1, None, full_size=4) is x
    assert all_to_all(x, 0, 1, None, from_size=3) is x
    assert gather_async(x, 0, None, full_size=3).wait() is x


# --- per-rank checks (run inside spawned ranks) ---


def _check_scatter(rank: int, world: int, group, shape, dim: int) -> None:
    x = _rand(1, *shape).requires_grad_()
    w = _rand(2, *shape)
    y = scatter(x, dim, group)
    _close(y, _shard(x.detach(), dim, world, rank), f"scatter{shape} dim {dim}")
    (y * _shard(w, dim, world, rank)).sum().backward()
    grad = x.grad.clone()
    if world > 1:
        dist.all_reduce(grad, group=group)
    _close(grad, w, f"scatter grad{shape} dim {dim}")


def _check_gather(rank: int, world: int, group, shape, dim: int, use_async: bool) -> None:
    full = _rand(3, *shape)
    local = _shard(full, dim, world, rank).clone().requires_grad_()
    if use_async:
        pending = gather_async(local, dim, group, full_size=shape[dim])
        busy = (full * 2).sum()  # work overlapping the collective
        y = pending.wait()
    else:
        busy = torch.zeros((), **F64)
        y = gather(local, dim, group, full_size=shape[dim])
    _close(y, full, f"gather{shape} dim {dim}")
    # every rank weighs the replicated result differently: the true gradient sums the weights
    (y * _rand(100 + rank, *shape)).sum().add(busy * 0).backward()
    expected = sum(_rand(100 + r, *shape) for r in range(world))
    _close(local.grad, _shard(expected, dim, world, rank), f"gather grad{shape} dim {dim}")


def _check_all_to_all(rank: int, world: int, group, shape, from_dim: int, to_dim: int, use_async: bool) -> None:
    full = _rand(4, *shape)
    w = _rand(5, *shape)
    local = _shard(full, from_dim, world, rank).clone().requires_grad_()
    if use_async:
        y = all_to_all_async(local, from_dim, to_dim, group, from_size=shape[from_dim]).wait()
    else:
        y = all_to_all(local, from_dim, to_dim, group, from_size=shape[from_dim])
    what = f"all_to_all{shape} {from_dim}->{to_dim}"
    _close(y, _shard(full, to_dim, world, rank), what)
    (y * _shard(w, to_dim, world, rank)).sum().backward()
    _close(local.grad, _shard(w, from_dim, world, rank), f"{what} grad")


def _check_overlapped_pair(rank: int, world: int, group) -> None:
    """Two collectives in flight at once, waited for in reverse order, in forward and backward."""
    n, s, c = 7, 5, 3
    m_full, z_full = _rand(6, s, n, c), _rand(7, n, n, c)
    m = _shard(m_full, 0, world, rank).clone().requires_grad_()
    z = _shard(z_full, 0, world, rank).clone().requires_grad_()
    pm = all_to_all_async(m, 0, 1, group, from_size=s)
    pz = gather_async(z, 0, group, full_size=n)
    z_whole, m_cols = pz.wait(), pm.wait()
    # m columns [S, n_local, C] against the pair rows of those columns
    start, stop = shard_range(n, world, rank)
    torch.einsum("sjc,ijc->sij", m_cols, z_whole[:, start:stop]).pow(2).sum().backward()
    ref_m, ref_z = m_full.clone().requires_grad_(), z_full.clone().requires_grad_()
    torch.einsum("sjc,ijc->sij", ref_m, ref_z).pow(2).sum().backward()
    _close(m.grad, _shard(ref_m.grad, 0, world, rank), "overlapped m grad")
    _close(z.grad, _shard(ref_z.grad, 0, world, rank), "overlapped z grad")


def _check_replicated_weights(rank: int, world: int, group) -> None:
    """A replicated Linear applied to shards: summed partial weight gradients equal the unsplit ones."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).double()
    ref = torch.nn.Linear(3, 2).double()
    ref.load_state_dict(lin.state_dict())
    x = _rand(8, 5, 3)
    y = gather(lin(scatter(x, 0, group)), 0, group, full_size=5)
    (y.tanh().sum() / world).backward()  # the same loss on every rank: each contributes 1/world
    all_reduce_grads(lin.parameters(), group)
    ref(x).tanh().sum().backward()
    _close(lin.weight.grad, ref.weight.grad, "replicated weight grad")
    _close(lin.bias.grad, ref.bias.grad, "replicated bias grad")


def _all_checks(rank: int, world: int) -> int:
    topo = Topology(world_size=world, rank=rank, dap=world).init()
    group = topo.group(Axis.DAP)
    for shape, dim in (((5, 7, 3), 0), ((5, 7, 3), 1), ((3, 2), 0), ((2, 9), -1)):
        _check_scatter(rank, world, group, shape, dim)
        for use_async in (False, True):
            _check_gather(rank, world, group, shape, dim, use_async)
    for shape, a, b in (((5, 7, 3), 0, 1), ((5, 7, 3), 1, 0), ((37, 3, 2), 0, 2), ((2, 3, 5), 2, 1)):
        for use_async in (False, True):
            _check_all_to_all(rank, world, group, shape, a, b, use_async)
    _check_overlapped_pair(rank, world, group)
    _check_replicated_weights(rank, world, group)
    if world > 1:  # a wrong shard is refused before any rank communicates, so nothing hangs
        with pytest.raises(ValueError, match=r"holds 3 rows, the shard of 4 is \d"):
            gather(torch.zeros(3), 0, group, full_size=4)
    topo.destroy()
    return rank


def test_primitives_match_unsplit_one_rank():
    """A one-rank gloo group, in this process (no spawn)."""
    from lowmem.core_parallel.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    try:
        assert _all_checks(0, 1) == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_primitives_match_unsplit(world):
    assert run_on_ranks(_all_checks, world, timeout=90) == list(range(world))
