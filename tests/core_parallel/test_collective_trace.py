"""Issue 43: a collective that times out says where each rank is, and says a rank exited only when its process is
gone (2 gloo ranks, collective timeouts of a few seconds, each run bounded by `run_on_ranks`' timeout)."""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.nn as nn

from lowmem import core_parallel
from lowmem.core_parallel import GeminiConfig, ZeroConfig, run_on_ranks
from lowmem.core_parallel.trace import TRACE_ENV, CollectiveTrace

TIMEOUT_S = 3.0
DIED = ("died", "dead", "exited", "gone")


def _says_a_rank_died(message: str) -> bool:
    return any(word in message.lower().replace("no process died", "") for word in DIED)


def _short_group():
    import torch.distributed as dist

    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S), backend="gloo")


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "dead": getattr(exc, "dead", None),
            "ranks": getattr(exc, "ranks", None)}


def _in_different_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group, other = _short_group(), _short_group()
    trace = CollectiveTrace.create(group)
    try:
        if rank == 0:
            with trace.collective("all_reduce(grad norm)"):
                dist.all_reduce(torch.ones(4), group=group)
        else:  # waits in a collective rank 0 never joins (its own group): alive, elsewhere
            with trace.collective("all_gather", chunk=3):
                dist.barrier(group=other)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return _error(exc)
    return {"type": None}


@pytest.mark.distributed
def test_a_rank_in_another_collective_is_named_where_it_is_not_as_dead():
    results = run_on_ranks(_in_different_collectives, 2, timeout=90)
    for rank, got in enumerate(results):
        assert got["type"] == "PeerLostError" and got["dead"] is False, got
        assert not _says_a_rank_died(got["message"]), got["message"]
        assert f"rank {1 - rank} (pid" in got["message"] and "alive" in got["message"], got["message"]
    assert "rank 1 in all_gather (chunk 3, step 0)" in results[0]["message"], results[0]["message"]
    assert "rank 0 in all_reduce(grad norm) (step 0)" in results[1]["message"], results[1]["message"]


def _zero_rank_sleeps(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, opt = core_parallel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2),
                                     group=_short_group())
    opt.backward(model(torch.randn(2, 8)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    if rank == 1:
        time.sleep(3 * TIMEOUT_S + 3)  # alive, in no collective, until rank 0 has explained its timeout
        return {"type": None}
    try:
        opt.backward(model(torch.randn(2, 8)).pow(2).mean())
        opt.step()
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    return {"type": None}


@pytest.mark.distributed
@pytest.mark.parametrize("traced", [False, True], ids=["default", "LOWMEM_TRACE_COLLECTIVES"])
def test_a_busy_rank_is_named_alive_with_its_last_collective_when_traced(traced):
    env = {TRACE_ENV: "1"} if traced else {TRACE_ENV: "0"}
    got = run_on_ranks(_zero_rank_sleeps, 2, timeout=90, env=env)[0]
    assert got["type"] == "PeerLostError" and got["dead"] is False, got
    assert not _says_a_rank_died(got["message"]), got["message"]
    assert "no process died (rank 1 (pid" in got["message"], got["message"]
    assert re.search(r"rank 0 in zero\.backward / reduce_scatter of bucket \d+ \(step 1\)", got["message"]), got
    if traced:  # every rank's last collective, also of one that is in none now
        assert "rank 1 in no traced collective; its last, zero.step (step 0), finished" in got["message"], got
    else:
        assert f"rank 1 (alive) in no traced collective that timed out with this one; {TRACE_ENV}=1" in got["message"]


def _gemini_rank_killed(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    config = GeminiConfig(host_collectives=False, peer_reads=False)  # gloo's collectives: they name no rank
    model, opt = core_parallel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    opt.backward(model(torch.randn(2, 8)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    if rank == 1:
        os._exit(3)  # no goodbye, as on an OOM kill
    started = time.monotonic()
    try:
        opt.backward(model(torch.randn(2, 8)).pow(2).mean())
        opt.step()
    except Exception as exc:  # noqa: BLE001
        return {**_error(exc), "seconds": time.monotonic() - started}
    return {"type": None}


@pytest.mark.distributed
def test_a_killed_rank_is_named_as_exited_under_gemini_over_gloo():
    got = run_on_ranks(_gemini_rank_killed, 2, timeout=90, may_die=[1])[0]
    assert got["type"] == "PeerLostError" and got["dead"] is True and got["ranks"] == [1], got
    assert "rank 1 (pid" in got["message"] and "exited" in got["message"], got["message"]
    assert got["seconds"] < 30, got  # noticed (the collective timeout is 90 s), not waited out
