"""Shared-memory collectives for CPU ranks against a float64 reference and gloo, on 1, 2 and 4 ranks: values,
rank order, a barrier timeout that names the missing rank, a dead rank noticed at once, the fallback when a
rank cannot map the segment, and no file left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from lowmem.core_parallel import run_on_ranks
from lowmem.core_parallel.host_comm import HostCollectives, PeerLostError, host_collectives_supported

pytestmark = pytest.mark.skipif(not host_collectives_supported(), reason="x86-64 Linux with /dev/shm only")

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _data(rank: int, seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 100 + rank), dtype=torch.float64)


def _collectives(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    hc = HostCollectives.create(None, slot_bytes=100)  # one page: the tensors below go through in pieces
    out = {"created": hc is not None}
    for dt in (torch.float32, torch.bfloat16):
        n = 3001  # 12 KiB of fp32: three pieces of a 4 KiB slot, the last one partial
        src = _data(rank, seed, n).to(dt)
        got = torch.empty(world * n, dtype=dt)
        hc.all_gather(got, src)
        ref = torch.empty_like(got)
        dist.all_gather_single(ref, src)
        full = _data(rank, seed + 1, world * 1500).to(dt)
        mine = torch.empty(1500, dtype=dt)
        hc.reduce_scatter(mine, full)
        out[str(dt)] = {"gather": got, "gloo_gather": ref, "reduced": mine.double()}
    out["shm_files"] = sorted(os.listdir("/dev/shm"))  # after collectives: rank 0 has unlinked the name
    hc.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_gather_and_reduce_scatter_match_float64_and_gloo(world):
    seed = int(torch.randint(0, 10_000, ()).item())
    results = run_on_ranks(_collectives, world, seed, timeout=120)
    for rank, res in enumerate(results):
        assert res["created"]
        assert not [f for f in res["shm_files"] if f.startswith("lowmem-host-comm-")]  # unlinked at setup
        for dt in (torch.float32, torch.bfloat16):
            r = res[str(dt)]
            want = torch.cat([_data(k, seed, 3001).to(dt) for k in range(world)])
            assert torch.equal(r["gather"], want)  # copies: exact, in rank order
            assert torch.equal(r["gloo_gather"], want)
            # float64 sum of what every rank put in (rounded to dt on the way in), this rank's part
            parts = [_data(k, seed + 1, world * 1500).to(dt).double()[rank * 1500 : (rank + 1) * 1500]
                     for k in range(world)]
            total, magnitude = sum(parts), sum(p.abs() for p in parts)
            # world - 1 additions in dt, each rounding by at most a unit roundoff of the running sum
            bound = (world - 1) * UNIT_ROUNDOFF[dt] * magnitude * 1.01
            assert ((r["reduced"] - total).abs() <= bound).all(), (dt, (r["reduced"] - total).abs().max())


def _late(rank: int, world: int) -> str:
    hc = HostCollectives.create(None, slot_bytes=64, timeout=1.0)
    if rank == 1:
        time.sleep(2.5)  # alive (busy) but never reaches the barrier
        return "skipped"
    try:
        hc.barrier()
    except PeerLostError as exc:
        return f"{exc} {exc.ranks} dead={exc.dead}"
    return "passed"


@pytest.mark.distributed
def test_barrier_names_the_rank_that_does_not_arrive():
    results = run_on_ranks(_late, 2, timeout=60)
    assert results[1] == "skipped"
    assert "ranks [1] did not arrive within 1s" in results[0] and "[1] dead=False" in results[0], results[0]


def _victim_dies_mid_collective(rank: int, world: int, victim: int) -> dict:
    import torch.distributed as dist

    # Ten minutes: only noticing the death, not this timeout, can end the wait within the test's time.
    hc = HostCollectives.create(None, slot_bytes=4096, timeout=600.0)
    out = torch.empty(world * 8)
    hc.all_gather(out, torch.full((8,), float(rank)))  # the group works
    if rank == victim:
        os._exit(3)  # no goodbye, as on an OOM kill
    t0 = time.monotonic()
    try:
        for _ in range(100):
            hc.reduce_scatter(torch.empty(8), torch.ones(world * 8))
    except dist.DistBackendError as exc:  # what gloo raises for a lost peer
        return {"error": type(exc).__name__, "message": str(exc), "ranks": exc.ranks, "dead": exc.dead,
                "waited_s": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [0, 1])
def test_a_dead_rank_ends_the_others_wait_at_once(victim):
    results = run_on_ranks(_victim_dies_mid_collective, 2, victim, timeout=60, may_die=[victim])
    got = results[1 - victim]
    assert results[victim] is None
    assert got["error"] == "PeerLostError", got
    assert (got["ranks"], got["dead"]) == ([victim], True)
    assert f"rank {victim} (pid " in got["message"] and "exited" in got["message"], got["message"]
    assert got["waited_s"] < 15, got  # the bound; the collective timeout is 600 s


def test_liveness_sees_zombies_and_reused_pids():
    from lowmem.core_parallel import peers as hcm

    me = hcm.start_time(os.getpid())
    assert me is not None and me > 0
    assert hcm.running(os.getpid(), me)
    assert not hcm.running(os.getpid(), me + 1)  # the pid now belongs to another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # exited but not reaped: a zombie, as a rank is while the launcher that spawned it is stuck
        deadline = time.monotonic() + 30
        while hcm.start_time(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hcm.start_time(child.pid) is None
        assert os.path.exists(f"/proc/{child.pid}")  # still there, as a zombie
    finally:
        child.wait()


def _timeout(rank: int, world: int) -> float:
    return HostCollectives.create(None, slot_bytes=64).timeout


def test_barrier_waits_as_long_as_the_process_group():
    # run_on_ranks sets the group's timeout to max(5, its own timeout)
    assert run_on_ranks(_timeout, 1, timeout=77) == [77.0]


def _cannot_map(rank: int, world: int) -> bool:
    from lowmem.core_parallel import host_comm as hcm

    if rank == world - 1:  # this rank cannot open the segment (another host, another /dev/shm)
        real = os.open

        def failing(path, *args, **kwargs):
            if "lowmem-host-comm-" in str(path):
                raise FileNotFoundError(path)
            return real(path, *args, **kwargs)

        hcm.os.open = failing
    return hcm.HostCollectives.create(None, slot_bytes=64) is None


@pytest.mark.distributed
def test_every_rank_falls_back_when_one_cannot_map_the_segment():
    assert run_on_ranks(_cannot_map, 2, timeout=60) == [True, True]


def _mismatch(rank: int, world: int) -> str:
    hc = HostCollectives.create(None, slot_bytes=4096)
    try:
        hc.all_gather(torch.empty(world * 2048 + 1), torch.zeros(2048))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_all_gather_output_of_the_wrong_size_is_refused():
    assert "out must hold 1 x 2048" in run_on_ranks(_mismatch, 1, timeout=60)[0]
