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
    # after a failure another rank may be gone: a barrier would wait for it for the whole collective timeout
    assert cli.main(["pgjob", "--store", str(tmp_path / "store"), "--fail"]) == 2
    assert job == []
