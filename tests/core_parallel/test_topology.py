from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lowmem.core_parallel import Axis, RankError, Topology, run_on_ranks


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="dap=3 does not divide world_size=4"):
        Topology(world_size=4, rank=0, dap=3)
    with pytest.raises(ValueError, match="rank must be"):
        Topology(world_size=2, rank=2)
    with pytest.raises(ValueError, match="backend"):
        Topology(world_size=1, backend="tcp")


def test_rank_layout_dap_fastest():
    t = Topology(world_size=8, rank=5, dap=2)
    assert (t.data, t.dap_rank, t.data_rank) == (4, 1, 2)
    assert t.ranks_of(Axis.DAP) == [4, 5]
    assert t.ranks_of(Axis.DATA) == [1, 3, 5, 7]
    assert t.ranks_of("world") == list(range(8))
    # every rank lands in exactly one group per axis
    for axis in (Axis.DAP, Axis.DATA):
        groups = {tuple(t.ranks_of(axis, r)) for r in range(8)}
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    t = Topology.from_env(dap=2, backend="gloo")
    assert (t.world_size, t.rank, t.dap, t.data) == (4, 3, 2, 2)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        Topology.from_env()
    given = Topology.from_env(backend="gloo", environ={"WORLD_SIZE": "2", "RANK": "1"})  # the process's ignored
    assert (given.world_size, given.rank) == (2, 1)
    assert Topology.from_env(backend="gloo", environ={}).world_size == 1


def test_single_process_needs_no_group():
    t = Topology().init()
    assert t.group(Axis.DATA) is None and not dist.is_initialized()
    t.destroy()


def _groups_on_rank(rank, world, dap):
    topo = Topology(world_size=world, rank=rank, dap=dap).init()
    out = {}
    for axis in (Axis.DATA, Axis.DAP, Axis.WORLD):
        pg = topo.group(axis)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        out[axis.value] = (t.item(), dist.get_world_size(pg))
    topo.destroy()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world,dap", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 1), (4, 4)])
def test_groups_by_axis(world, dap):
    results = run_on_ranks(_groups_on_rank, world, dap, timeout=90)
    for rank, out in enumerate(results):
        topo = Topology(world_size=world, rank=rank, dap=dap)
        for axis in (Axis.DATA, Axis.DAP, Axis.WORLD):
            ranks = topo.ranks_of(axis)
            assert out[axis.value] == (float(sum(ranks)), len(ranks))


def _raise_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    # the other ranks block in a collective the failed rank never joins
    dist.barrier()
    return rank


@pytest.mark.distributed
def test_failing_rank_fails_fast_with_its_error():
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised ValueError: boom on purpose"):
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def _hang(rank, world):
    if rank == 0:
        time.sleep(600)
    return rank


@pytest.mark.distributed
def test_hang_becomes_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
        run_on_ranks(_hang, 2, timeout=8)


def _results(rank, world, scale):
    return rank * scale, torch.full((1000,), float(rank))


@pytest.mark.distributed
def test_results_in_rank_order():
    out = run_on_ranks(_results, 4, 10, timeout=60)
    assert [o[0] for o in out] == [0, 10, 20, 30]
    # Tensors come back by value: still readable after every rank has exited (run_on_ranks joined them).
    for rank, (_, t) in enumerate(out):
        assert torch.equal(t, torch.full((1000,), float(rank)))
