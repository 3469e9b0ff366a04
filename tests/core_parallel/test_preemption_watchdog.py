"""SIGTERM ends a rank that waits in a collective its peer never joins (issue 43): exit 143 within seconds, with one
line naming where the rank is, in a plain loop (`core_parallel.preemption.Preemption`) and under a Lightning strategy
(zero2). Before the watchdog such a rank ran on until the collective's timeout (here 120 s, Lightning's default
1800 s): Python runs no signal handler while the main thread is inside gloo's wait.

The ranks are subprocesses started with torchrun's environment so the test sees each one's exit code; both pairs
start together (each costs seconds of imports on the shared machine).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lowmem.core_parallel.launch import free_port
from lowmem.core_parallel.preemption import GRACE_ENV, SIGTERM_EXIT_CODE, Preemption
from tests._paths import tests_only_path as _tests_only_path

GRACE_S = 2.0
EXIT_WITHIN_S = GRACE_S + 8.0  # after the signal: the grace, the watchdog's polling, the log flush

_PLAIN = textwrap.dedent(
    """
    import datetime, os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from lowmem.core_parallel.preemption import Preemption
    from lowmem.core_parallel.trace import CollectiveTrace

    rank, root = int(os.environ["RANK"]), Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    trace = CollectiveTrace.create(None)
    with Preemption() as preemption:
        preemption.trace = trace
        if rank == 0:
            (root / "waiting").touch()
            with trace.collective("all_reduce(loss)"):
                dist.all_reduce(torch.ones(1))  # rank 1 never joins
            (root / "returned").touch()
        else:
            time.sleep(120)
    """
)

_LIGHTNING = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning.pytorch as pl
    from lowmem import recipes  # noqa: F401  (registers the names)

    root = Path(sys.argv[1])

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

        def training_step(self, batch, batch_idx):
            if self.global_step == 2 and self.global_rank == 1:
                (root / "waiting").touch()
                time.sleep(120)  # rank 1 is elsewhere: rank 0 waits for it in a collective
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)

    trainer = pl.Trainer(strategy="zero2", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, default_root_dir=str(root))
    trainer.fit(Tiny())
    (root / "returned").touch()
    """
)


def _env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
               NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=_tests_only_path(), PYTHONSAFEPATH="1")
    env[GRACE_ENV] = str(GRACE_S)
    return env


@pytest.fixture(scope="module")
def stuck_runs(tmp_path_factory) -> dict:
    """Both pairs at once; rank 0 of each gets SIGTERM once its peer is elsewhere and it waits (or is about to) in a
    collective. Every process still running 60 s after its start is killed."""
    runs = {}
    for kind, script in (("plain", _PLAIN), ("lightning", _LIGHTNING)):
        root = tmp_path_factory.mktemp(kind)
        port = free_port()
        logs = [open(root / f"rank{r}.err", "w+") for r in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", script, str(root)], env=_env(r, port),
                                  stdout=subprocess.DEVNULL, stderr=logs[r], text=True) for r in range(2)]
        runs[kind] = {"root": root, "procs": procs, "logs": logs, "signalled": None, "ended": None}
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and any(run["ended"] is None for run in runs.values()):
            now = time.monotonic()
            for run in runs.values():
                rank0 = run["procs"][0]
                if run["signalled"] is None and (run["root"] / "waiting").exists():
                    time.sleep(1.0)  # rank 0 reaches its collective (the watchdog serves either way)
                    rank0.send_signal(signal.SIGTERM)
                    run["signalled"] = time.monotonic()
                if run["ended"] is None and rank0.poll() is not None:
                    run["ended"] = now
                if run["signalled"] is not None and run["ended"] is None and now - run["signalled"] > 30:
                    rank0.kill()  # still running: the test fails below
            time.sleep(0.05)
    finally:
        for run in runs.values():
            for p in run["procs"]:
                if p.poll() is None:
                    p.kill()
                p.wait()
    out = {}
    for kind, run in runs.items():
        stderr = []
        for f in run["logs"]:
            f.seek(0)
            stderr.append(f.read())
            f.close()
        took = run["ended"] - run["signalled"] if None not in (run["ended"], run["signalled"]) else None
        out[kind] = {"code": run["procs"][0].returncode, "stderr": stderr[0], "took": took, "root": run["root"],
                     "signalled": run["signalled"] is not None}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["plain", "lightning"])
def test_sigterm_ends_a_rank_waiting_in_a_collective(stuck_runs, kind):
    run = stuck_runs[kind]
    assert run["signalled"], f"the peer never got stuck:\n{run['stderr'][-3000:]}"
    assert run["code"] == SIGTERM_EXIT_CODE, (run["code"], run["stderr"][-3000:])
    assert run["took"] is not None and run["took"] < EXIT_WITHIN_S, (run["took"], run["stderr"][-3000:])
    assert not (run["root"] / "returned").exists()
    lines = [ln for ln in run["stderr"].splitlines() if "did not reach a step boundary" in ln]
    assert len(lines) == 1, run["stderr"][-3000:]
    line = lines[0]
    assert line.startswith("rank 0: SIGTERM received") and f"Exiting with code {SIGTERM_EXIT_CODE}" in line, line
    assert "main thread in " in line, line
    if kind == "plain":  # the trace's collective, and the rank's own code below torch's frames
        assert "rank 0 in all_reduce(loss) (step 0) for " in line and "called from <module> (<string>:" in line, line
    else:  # ZeRO's traced collective of step 2; Lightning's resume hint
        assert "rank 0 in zero." in line and "step 2)" in line and "Last complete checkpoint: none saved" in line, line


def test_grace_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv(GRACE_ENV, raising=False)
    assert Preemption().grace_s == 10.0
    assert Preemption(grace_s=3).grace_s == 3.0
    monkeypatch.setenv(GRACE_ENV, "inf")
    assert Preemption().grace_s == math.inf
    monkeypatch.setenv(GRACE_ENV, "soon")
    with pytest.raises(ValueError, match=GRACE_ENV):
        Preemption()
    with pytest.raises(ValueError, match="grace_s"):
        Preemption(grace_s=0)


def test_the_watchdog_stands_down_at_the_boundary_and_gives_the_wakeup_fd_back():
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    with Preemption(grace_s=0.3) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested()  # the boundary: the caller checkpoints, however long that takes
        time.sleep(1.0)  # the main thread stays here: a watchdog still armed would end this process
    assert signal.set_wakeup_fd(before) == before
    with Preemption(grace_s=math.inf) as preemption:  # no watchdog at all
        assert signal.set_wakeup_fd(before) == before
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        assert preemption.signalled
