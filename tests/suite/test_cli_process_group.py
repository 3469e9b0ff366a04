"""Issue 43: a command run by the `suite` CLI inside a distributed job ends its process groups before the
interpreter exits (a barrier, then `destroy_process_group`), so no rank tears down its groups and store connection
while another still uses them. The command here is this module (`add_arguments` and `run` below)."""

from __future__ import annotations

import argparse

import pytest
import torch.distributed as dist

from lowmem.suite import cli
from lowmem.suite.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True)
    parser.add_argument("--fail", action="store_true")


def run(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo", store=dist.FileStore(args.store, 1), rank=0, world_size=1)
    if args.fail:
        raise UsageError("bad input")
    return 0


@pytest.fixture
def job(monkeypatch) -> list[str]:
    monkeypatch.setitem(cli.COMMANDS, "pgjob", (__name__, "a one-rank job"))
    calls: list[str] = []
    barrier, destroy = dist.barrier, dist.destroy_process_group
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (calls.append("barrier"), barrier(*a, **k))[1])
    monkeypatch.setattr(dist, "destroy_process_group",
                        lambda *a, **k: (calls.append("destroy"), destroy(*a, **k))[1])
    return calls


def test_a_successful_run_ends_its_process_group_after_a_barrier(job, tmp_path):
    assert cli.main(["pgjob", "--store", str(tmp_path / "store")]) == 0
    assert not dist.is_initialized()
    assert job == ["barrier", "destroy"]


def test_a_failed_run_does_not_wait_at_a_barrier(job, tmp_path):
    # after a failure another rank may be gone: a barrier would wait for it for the whole collective timeout; the
    # group is still destroyed, without one, so the interpreter's teardown does not abort the rank (exit -6)
    assert cli.main(["pgjob", "--store", str(tmp_path / "store"), "--fail"]) == 2
    assert job == ["destroy"] and not dist.is_initialized()


def test_a_failed_closing_barrier_is_named_and_the_group_still_ends(job, tmp_path, monkeypatch, caplog):
    """Another rank that failed and exited breaks the closing barrier: this rank's finished work keeps its exit code
    (no traceback, no hang), the warning says why, and the group is destroyed all the same."""

    def broken_barrier(*args, **kwargs):
        job.append("barrier")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\nmore detail")

    monkeypatch.setattr(dist, "barrier", broken_barrier)
    with caplog.at_level("WARNING"):
        assert cli.main(["pgjob", "--store", str(tmp_path / "store")]) == 0
    assert job == ["barrier", "destroy"] and not dist.is_initialized()
    assert "closing barrier failed" in caplog.text and "Connection closed by peer" in caplog.text
    assert "more detail" not in caplog.text
