"""`suite diffusion finetune --devices 2 --strategy gemini` under faults, as a user's job meets them: a rank
killed mid-run ends the other within seconds with advice naming a checkpoint that exists; SIGTERM (a
preempted job) writes a checkpoint, exits 143 on every rank, and the run resumes from it with `latest`.

The two ranks are started as a launcher (torchrun, a cluster) starts them, one process each, so the test
knows which pid is which rank. The collective timeout is the default (30 minutes): only noticing the fault
ends the run in time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowmem.core_parallel.launch import free_port

pytestmark = pytest.mark.distributed
SUITE = str(Path(sys.executable).parent / "suite")
SURVIVOR_S = 15.0  # the bound
ARGS = ["diffusion", "finetune", "--devices", "2", "--strategy", "gemini", "--resolution", "32",
        "--train_batch_size", "1", "--max_train_steps", "400", "--checkpointing_steps", "2", "--report_to", "csv"]


def _start(out: Path, logs: Path, extra: list[str] = ()) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")
        err = open(logs / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([SUITE, *ARGS, "--output_dir", str(out), *extra], env=env,
                                      stdout=err, stderr=subprocess.STDOUT))
        err.close()
    return procs


def _wait_for_checkpoint(out: Path, procs, timeout=240.0) -> None:
    deadline = time.monotonic() + timeout
    while not list(out.glob("checkpoint-*")):
        assert all(p.poll() is None for p in procs), "a rank ended before the first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within the time"
        time.sleep(0.05)


def _ended_within(procs, limit: float) -> list[float | None]:
    """Seconds until each process ended (None: still running after `limit`, then killed)."""
    t0, ended = time.monotonic(), [None] * len(procs)
    while time.monotonic() - t0 < limit and None in ended:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return ended


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both faults at once (the imports dominate): rank 1 killed / rank 0 terminated after checkpoint-2."""
    roots = {f: tmp_path_factory.mktemp(f) for f in ("kill", "sigterm")}
    procs = {f: _start(root / "out", root) for f, root in roots.items()}
    try:
        for f in procs:
            _wait_for_checkpoint(roots[f] / "out", procs[f])
            procs[f][1 if f == "kill" else 0].send_signal(signal.SIGKILL if f == "kill" else signal.SIGTERM)
        ended = {f: _ended_within(p, 120.0) for f, p in procs.items()}
    finally:
        for p in (p for ps in procs.values() for p in ps):
            if p.poll() is None:
                p.kill()
                p.wait()
    return {f: {"root": roots[f], "out": roots[f] / "out", "ended": ended[f],
                "codes": [p.returncode for p in procs[f]],
                "logs": [(roots[f] / f"rank{r}.log").read_text() for r in range(2)]} for f in roots}


def test_a_killed_rank_ends_the_other_within_seconds_naming_a_checkpoint_that_exists(runs):
    run = runs["kill"]
    survivor, log = run["ended"][0], run["logs"][0]
    assert run["codes"][1] == -signal.SIGKILL
    assert survivor is not None and survivor < SURVIVOR_S, (survivor, log[-3000:])
    assert run["codes"][0] not in (0, -signal.SIGKILL), log[-3000:]  # stopped by itself, not as a success
    assert "lost contact with rank 1" in log, log[-3000:]
    named = re.search(r"Last complete checkpoint: (\S+); resume with --resume_from_checkpoint latest", log)
    assert named, log[-3000:]
    assert Path(named.group(1)).parent == run["out"] and re.fullmatch(r"checkpoint-\d+", Path(named.group(1)).name)
    assert Path(named.group(1)).is_dir(), "the advice names a folder that is not there"


def test_sigterm_saves_a_checkpoint_exits_143_and_resumes(runs):
    from lowmem.recipes.strategies import SIGTERM_EXIT_CODE

    run = runs["sigterm"]
    assert run["codes"] == [SIGTERM_EXIT_CODE] * 2, (run["codes"], run["logs"][0][-3000:], run["logs"][1][-3000:])
    line = [ln for ln in run["logs"][0].splitlines() if "SIGTERM received" in ln]
    assert line and "resume with --resume_from_checkpoint latest" in line[0], run["logs"][0][-3000:]
    saved = re.search(r"stopped after step (\d+)", line[0])
    assert saved, line[0]
    step = int(saved.group(1))
    assert (run["out"] / f"checkpoint-{step}").is_dir() and str(run["out"] / f"checkpoint-{step}") in line[0]
    assert not (run["out"] / "unet").exists(), "a preempted run must not look finished (no export)"
    # resume on one rank from the 2-rank checkpoint, two steps more
    args = list(ARGS)
    del args[args.index("--devices"):args.index("--devices") + 2]
    args[args.index("--max_train_steps") + 1] = str(step + 2)
    done = subprocess.run([SUITE, *args, "--output_dir", str(run["out"]), "--resume_from_checkpoint", "latest"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"resuming from {run['out'] / f'checkpoint-{step}'} (step {step}, epoch " in done.stderr
    assert f"the run ends at step {step + 2})" in done.stderr
    assert (run["out"] / "unet").is_dir()  # finished: exported
