"""`core_parallel.preemption.Preemption` in a plain ZeRO loop: SIGTERM on one rank stops every rank after the same
step, each saves its part of one checkpoint and exits 143; the checkpoint loads."""

from __future__ import annotations

import os
import signal

import torch
import torch.nn as nn

from lowmem import core_parallel
from lowmem.core_parallel import ZeroConfig, run_on_ranks
from lowmem.core_parallel.preemption import SIGTERM_EXIT_CODE, Preemption


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loop(rank: int, world: int, folder: str, signalled_rank: int) -> dict:
    model = _model()
    model, opt = core_parallel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2))
    step = -1
    try:
        with Preemption() as preemption:
            for step in range(20):
                g = torch.Generator().manual_seed(step * world + rank)
                opt.backward(model(torch.randn(4, 6, generator=g)).pow(2).mean())
                if rank == signalled_rank and step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step, between backward and step
                opt.step()
                opt.zero_grad()
                if preemption.requested():
                    core_parallel.save_checkpoint(folder, model, opt, extra={"step": step})
                    preemption.exit()
    except SystemExit as exc:
        return {"code": exc.code, "step": step, "weights": {k: v.clone() for k, v in model.state_dict().items()}}
    return {"code": None, "step": step}


def test_sigterm_on_one_rank_stops_both_at_the_same_step_with_a_checkpoint(tmp_path):
    folder = str(tmp_path / "preempted")
    results = run_on_ranks(_loop, 2, folder, 1, timeout=60)
    assert [r["code"] for r in results] == [SIGTERM_EXIT_CODE] * 2, results
    assert [r["step"] for r in results] == [3, 3]
    model = _model()
    extra = core_parallel.load_checkpoint(folder, model)
    assert extra == {"step": 3}
    for k, v in model.state_dict().items():
        assert torch.equal(v, results[0]["weights"][k]) and torch.equal(v, results[1]["weights"][k]), k


def test_without_a_signal_nothing_is_requested_and_the_old_handler_comes_back():
    seen = []
    before = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with Preemption() as preemption:
            assert not preemption.requested()
            os.kill(os.getpid(), signal.SIGTERM)
            assert preemption.requested() and seen == [signal.SIGTERM]  # the previous handler still runs
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, before)
