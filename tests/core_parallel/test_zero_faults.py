"""Plain-API ZeRO: a rank killed mid-step (no goodbye, as on an OOM kill) is named in the survivors' error."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn

from lowmem import core_parallel
from lowmem.core_parallel import ZeroConfig, run_on_ranks


def _victim_dies_mid_step(rank: int, world: int, victim: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, opt = core_parallel.setup(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage))
    started = time.monotonic()
    try:
        for step in range(4):
            loss = model(torch.randn(2, 8)).pow(2).mean()
            if rank == victim and step == 2:
                os._exit(3)  # after the forward, before its reduce-scatter: the others are already waiting
            started = time.monotonic()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        return {"error": type(exc).__name__, "message": str(exc), "ranks": getattr(exc, "ranks", None),
                "cause": type(exc.__cause__).__name__, "seconds": time.monotonic() - started}
    return {"error": None}


def test_a_killed_rank_is_named_in_the_survivors_error():
    # three ranks: the dead one is named, not guessed as "the other one"
    results = run_on_ranks(_victim_dies_mid_step, 3, 1, 2, timeout=60, may_die=[1])
    for rank in (0, 2):
        got = results[rank]
        assert got["error"] == "PeerLostError", got
        assert "rank 1 (pid" in got["message"] and got["message"].startswith(f"rank {rank}:"), got
        assert 1 in got["ranks"], got
        assert got["seconds"] < 15, got  # the collective timeout is 60 s: the death was noticed, not waited out
