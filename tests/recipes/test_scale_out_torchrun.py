"""Issue 37, multi-node runs started by a launcher: an output folder that is not shared by the "nodes" stops the
fine-tune before training with one line naming the node, exit 2; `suite fold` under a launcher stops at once with
one line saying how to run it, exit 2 (never a silent hang); a DAP rendezvous a rank does not come to fails
within its connect timeout naming the rank.

The ranks are started as a launcher starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, one process each; torchrun
itself runs in tests/suite/test_docs_scale_out.py), so each process's exit code is seen."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowmem.core_parallel.launch import free_port

SUITE = str(Path(sys.executable).parent / "suite")


def _launch(argvs: list[list[str]], logs: Path, **extra_env: str) -> list[subprocess.Popen]:
    """One process per rank, each `SUITE *argv` with the variables a launcher sets, one node per rank."""
    port, procs = free_port(), []
    for rank, argv in enumerate(argvs):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(len(argvs)),
                   RANK=str(rank), LOCAL_RANK="0", NODE_RANK=str(rank), LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
                   **extra_env)
        with open(logs / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([SUITE, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


@pytest.mark.distributed
def test_an_output_folder_the_nodes_do_not_share_is_one_line_and_exit_2_before_training(tmp_path):
    """Two "nodes", each with its own folder at --output_dir (as a path on each node's local disk would be)."""
    base = ["diffusion", "finetune", "--devices", "1", "--num_nodes", "2", "--strategy", "zero2", "--resolution", "32",
            "--train_batch_size", "1", "--max_train_steps", "2", "--checkpointing_steps", "1", "--report_to", "csv"]
    outs = [tmp_path / "node0" / "out", tmp_path / "node1" / "out"]
    codes = _wait(_launch([[*base, "--output_dir", str(out)] for out in outs], tmp_path), 180)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [2, 2], (codes, logs[0][-3000:], logs[1][-3000:])
    line = [ln for ln in logs[0].splitlines() if "--output_dir" in ln and "error" in ln]
    assert len(line) == 1, logs[0][-3000:]
    assert f"--output_dir {outs[0]}: is not the same folder on every node" in line[0]
    assert "does not see the files rank 1 (" in line[0] and "every node mounts at the same path" in line[0]
    assert "Traceback" not in logs[0]
    for out in outs:  # nothing trained, no checkpoint, no export, no probe left
        assert not list(out.glob("checkpoint-*")) and not (out / "unet").exists() and not list(out.glob(".lowmem-*"))


@pytest.mark.distributed
def test_fold_under_a_launcher_is_exit_2_within_60_s_on_every_rank(tmp_path):
    argv = ["fold", "--devices", "2", "--no-relax", "--output_dir", str(tmp_path / "out")]
    t0 = time.monotonic()
    codes = _wait(_launch([argv, argv], tmp_path, TORCHELASTIC_RUN_ID="test"), 60)
    seconds = time.monotonic() - t0
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [2, 2], (codes, seconds, logs[0][-3000:])
    for rank, log in enumerate(logs):
        assert f"this process is rank {rank} of 2 started by torchrun" in log, log[-2000:]
        assert "'suite fold --devices N'" in log and "--ray_address" in log, log[-2000:]
    assert not (tmp_path / "out").exists(), "fold did work before refusing"


def test_refusal_needs_more_than_one_process():
    from lowmem.fastfold.dap import refuse_under_launcher
    from lowmem.utils.errors import InputError

    refuse_under_launcher(environ={})
    refuse_under_launcher(environ={"WORLD_SIZE": "1", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"})
    with pytest.raises(InputError, match=r"rank 3 of 4 started by a launcher \(WORLD_SIZE=4\)"):
        refuse_under_launcher(environ={"WORLD_SIZE": "4", "RANK": "3"})


def test_a_dap_rendezvous_a_rank_does_not_come_to_fails_naming_it():
    """Rank 0 alone: rank 1 is named; rank 1 alone (nobody at rank 0's address): the address is named. Both
    within the connect timeout (seconds here; 60 s by default) instead of the 30-minute collective timeout."""
    import torch.distributed as dist

    from lowmem.fastfold.dap import _join_group

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"rank 1 of 2 did not join the rendezvous at 127.0.0.1:{port} within 2 s"):
        _join_group(0, 2, port, "gloo", 1800.0, connect_s=2.0)
    assert time.monotonic() - t0 < 30 and not dist.is_initialized()
    port = free_port()
    with pytest.raises(TimeoutError, match=rf"rank 1 of 2: could not reach rank 0's rendezvous at 127.0.0.1:{port}"):
        _join_group(1, 2, port, "gloo", 1800.0, connect_s=2.0)
    assert time.monotonic() - t0 < 60 and not dist.is_initialized()
