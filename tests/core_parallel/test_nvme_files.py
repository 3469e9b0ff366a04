"""Gemini's NVMe offload files in a folder that may be shared: two live jobs are refused with one line, a
killed run's files are removed by the next, planted links are never followed, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from lowmem.core_parallel.gemini import GeminiConfig, setup_gemini
from lowmem.core_parallel.gemini.storage import NvmeFile, NvmeTierError, TieredBuffer, remove_stale_files
from tests.core_parallel.gemini_helpers import batch, build

# A second process holding an open tier in FOLDER as rank 0: prints its pid once open, then waits for stdin
_HOLDER = textwrap.dedent("""
    import os, sys
    from lowmem.core_parallel.gemini.storage import NvmeFile
    f = NvmeFile(sys.argv[1], rank=0)
    f.reserve(1024)
    f.open()
    print(os.getpid(), f.path, flush=True)
    sys.stdin.read()
    f.close()
""")


@pytest.fixture
def holder(tmp_path):
    procs = []

    def start(folder):
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        line = p.stdout.readline().split()
        assert line, "the holder process did not open its tier"
        return p, int(line[0]), line[1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _names(folder):
    return sorted(os.listdir(folder))


def test_a_folder_held_by_a_live_job_is_refused_with_one_line(tmp_path, holder):
    proc, pid, path = holder(tmp_path)
    theirs = open(path, "rb").read()
    mine = NvmeFile(tmp_path, rank=0)
    mine.reserve(1024)
    with pytest.raises(NvmeTierError) as err:
        mine.open()
    msg = str(err.value)
    assert "\n" not in msg and f"in use by another live job (pid {pid} holds rank 0's lock)" in msg, msg
    assert open(path, "rb").read() == theirs and os.path.exists(path)  # their file untouched
    # another rank number is a different rank of some job: allowed (ranks of one job share the folder)
    other = NvmeFile(tmp_path, rank=1)
    other.reserve(10)
    other.open()
    other.close()
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert _names(tmp_path) == []  # closed: data file and lock removed
    mine.open()  # free now
    mine.close()
    assert _names(tmp_path) == []


def test_a_killed_runs_files_are_removed_by_the_next_run(tmp_path, holder):
    proc, _, path = holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.basename(path) in _names(tmp_path)  # a kill leaves it
    nv = NvmeFile(tmp_path, rank=0)
    nv.reserve(10)
    nv.open()
    assert not os.path.exists(path)
    assert _names(tmp_path) == sorted([nv.path.name, "gemini-rank0.lock"])
    nv.close()
    assert _names(tmp_path) == []


def test_planted_links_are_never_followed(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    folder = tmp_path / "offload"
    folder.mkdir()
    # the names older versions used, a name shaped like ours, and the lock: all links to the victim
    for name in ("gemini-rank0.bin", "gemini-rank1-0123456789abcdef.bin"):
        (folder / name).symlink_to(victim)
    nv = NvmeFile(folder, rank=1)
    nv.reserve(4096)
    nv.open()
    assert not nv.path.is_symlink() and nv.path.name not in ("gemini-rank0.bin", "gemini-rank1-0123456789abcdef.bin")
    nv.close()
    assert remove_stale_files(folder) == []  # links are not ours to remove
    (folder / "gemini-rank2.lock").symlink_to(victim)
    nv2 = NvmeFile(folder, rank=2)
    with pytest.raises(NvmeTierError, match="gemini-rank2.lock.*symbolic link"):
        nv2.open()
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in folder.iterdir()) == ["gemini-rank0.bin", "gemini-rank1-0123456789abcdef.bin",
                                                       "gemini-rank2.lock"]


def test_one_process_may_open_several_tiers_in_one_folder(tmp_path):
    a, b = NvmeFile(tmp_path, rank=0), NvmeFile(tmp_path, rank=0)
    bufs = []
    for nv in (a, b):
        bufs.append(TieredBuffer(100, "device", torch.device("cpu"), nv, nv.reserve(100)))
        nv.open()
    assert a.path != b.path
    data = torch.randn(100)
    bufs[1].allocate(fill=data)
    a.close()
    assert "gemini-rank0.lock" in _names(tmp_path)  # still held for b
    bufs[1].move("nvme")
    bufs[1].move("device")
    torch.testing.assert_close(bufs[1].view(), data, rtol=0, atol=0)
    b.close()
    assert _names(tmp_path) == []


def test_gemini_setup_in_a_folder_another_job_holds_fails_and_leaves_the_model(tmp_path, holder):
    holder(tmp_path)
    model, opt = build("adam")
    keep = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = GeminiConfig(chunk_mb=40 * 4 / 2**20, offload_dir=str(tmp_path), offload_param_frac=1.0,
                       offload_optim_frac=1.0)
    with pytest.raises(NvmeTierError, match="in use by another live job"):
        setup_gemini(model, opt, cfg)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, keep[k], rtol=0, atol=0)
    x, _ = batch(0)
    model(x, True)  # still a plain, usable module
