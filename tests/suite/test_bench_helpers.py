"""Helpers of the benchmarks: the DAP budget fit and search, the fair-baseline optimizer choice, and memory as
the kernel charges it (page cache included). No model runs, no timed assertions."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from lowmem.suite.bench.dap import fit_longest, search_longest
from lowmem.suite.bench.harness import fast_optimizer
from lowmem.utils import memory_meter as memory

MIB = 2**20
_WRITE = (  # a child process writes 64 MiB through the page cache (no fsync, no O_DIRECT) and exits
    "import sys\n"
    "with open(sys.argv[1], 'wb') as f:\n"
    "    for _ in range(64):\n"
    "        f.write(b'\\x01' * (1 << 20))\n"
)


def _quadratic(a: float, b: float):
    return lambda n: a * n * n + b * n


@pytest.mark.parametrize("seed", range(5))
def test_fit_longest_recovers_the_crossing_of_a_quadratic(seed):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-4, 1e-2), rng.uniform(0.01, 2.0)
    peak = _quadratic(a, b)
    budget = peak(rng.randint(50, 2000)) + rng.uniform(0, 1)
    n = fit_longest((64, peak(64)), (128, peak(128)), budget)
    assert peak(n) <= budget < peak(n + 1)


def test_fit_longest_linear_peak():
    assert fit_longest((10, 20.0), (20, 40.0), 100.0) == 50


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("tol", [1, 4])
def test_search_longest_brackets_and_bisects(seed, tol):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-4, 1e-2), rng.uniform(0.01, 2.0)
    peak = _quadratic(a, b)
    true_n = rng.randint(40, 1500)
    budget = peak(true_n) + 1e-9
    calls = []

    def measure(n):
        calls.append(n)
        return peak(n)

    known: dict[int, float] = {}
    guess = max(8, int(true_n * rng.uniform(0.3, 2.5)))
    n = search_longest(measure, budget, guess, tol, known)
    assert peak(n) <= budget
    assert true_n - n < tol + 1 and n <= true_n
    assert set(calls) == set(known) and len(calls) == len(set(calls))  # each size measured once
    assert len(calls) < 40


def test_search_longest_nothing_fits():
    assert search_longest(lambda n: 1e6, 10.0, 100, 1, {}) == 0


# ---- fair baselines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_fast_optimizer_runs_the_fastest_implementation_and_says_which(cls):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    ref = torch.nn.Parameter(p.detach().clone())
    opt, impl = fast_optimizer(cls, [p], lr=0.1)
    plain = cls([ref], lr=0.1, foreach=False)
    assert impl in ("fused", "foreach")
    assert opt.defaults[impl] is True
    for _ in range(3):  # same update as the per-tensor loop (a float64 reference)
        g = torch.randn_like(p)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
    torch.testing.assert_close(p, ref)


def test_fast_optimizer_falls_back_to_the_loop():
    class LoopOnly(torch.optim.SGD):
        def __init__(self, params, **kw):
            if kw.get("fused") or kw.get("foreach"):
                raise RuntimeError("no such implementation")
            super().__init__(params, **kw)

    _, impl = fast_optimizer(LoopOnly, [torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert impl == "for-loop"


# ---- memory as the kernel charges it ----------------------------------------------------------------------


def _write_in_child(path) -> None:
    subprocess.run([sys.executable, "-c", _WRITE, str(path)], check=True)


def test_mincore_counts_a_file_written_by_another_process(tmp_path):
    target = tmp_path / "tier.bin"
    _write_in_child(target)
    assert memory.file_resident_bytes(str(target)) >= 60 * MIB
    assert memory.files_resident_bytes([str(tmp_path)]) >= 60 * MIB
    # clean pages dropped from the cache are no longer counted: the count follows the cache, not the size
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert memory.file_resident_bytes(str(target)) < 32 * MIB


def test_mincore_of_empty_and_missing_files(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "small").write_bytes(b"x" * 10)
    assert memory.file_resident_bytes(str(tmp_path / "empty")) == 0
    assert 10 <= memory.file_resident_bytes(str(tmp_path / "small")) <= os.sysconf("SC_PAGE_SIZE")
    assert memory.files_resident_bytes([str(tmp_path / "gone")]) == 0


@pytest.mark.parametrize("use_cgroup", [True, False], ids=["available-method", "mincore-fallback"])
def test_whole_command_peak_counts_page_cache(tmp_path, use_cgroup):
    target = tmp_path / "tier.bin"
    out = memory.run_command([sys.executable, "-c", _WRITE, str(target)], offload_paths=[str(tmp_path)],
                             use_cgroup=use_cgroup, timeout=120)
    assert out["returncode"] == 0
    assert out["method"].startswith("cgroup" if use_cgroup and memory.cgroup_method() != "rss+mincore" else "rss+")
    # the command's own RSS is ~10 MiB: the 64 MiB can only come from the page cache it wrote
    assert out["peak_bytes"] >= 60 * MIB, out


def test_whole_command_fallback_sees_the_tree(tmp_path):
    """Without a cgroup, memory held by a grandchild counts (sampled tree RSS / ru_maxrss)."""
    grandchild = "b = bytearray(96 << 20); b[::4096] = b'\\x01' * len(b[::4096]); import time; time.sleep(0.5)"
    argv = [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"]
    out = memory.run_command(argv, use_cgroup=False, timeout=120)
    assert out["returncode"] == 0
    assert out["peak_bytes"] >= 90 * MIB, out


def test_whole_command_fallback_does_not_count_the_parents_peak():
    """A child's ru_maxrss starts at its parent's peak (Linux keeps it across fork and exec): a small command
    started by a large process must not be reported at the parent's size. Run from a fresh process, so the
    parent's history is only the 400 MiB it allocates."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux /proc")
    code = (
        "import json, sys\n"
        "from lowmem.utils import memory_meter as memory\n"
        "ballast = bytearray(400 << 20)\n"
        "ballast[::4096] = b'x' * len(ballast[::4096])\n"
        "out = memory.run_command([sys.executable, '-c', 'import time; time.sleep(0.3)'], use_cgroup=False,"
        " timeout=60)\n"
        "print(json.dumps({k: v for k, v in out.items() if isinstance(v, (int, float, str))}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["children_maxrss_bytes"] >= 400 * MIB  # what the child's rusage says
    assert out["peak_bytes"] < 100 * MIB, out  # what the command held


def test_whole_command_returncode_and_cleanup(tmp_path):
    out = memory.run_command([sys.executable, "-c", "raise SystemExit(3)"], timeout=60)
    assert out["returncode"] == 3
    if out["method"].startswith("cgroup"):
        probe = memory.Cgroup.create("x")
        probe.remove()
        left = [n for n in os.listdir(os.path.dirname(probe.path)) if n.startswith(f"lowmem-cmd-{os.getpid()}-")]
        assert not left


@pytest.mark.parametrize("use_cgroup", [True, False], ids=["available-method", "mincore-fallback"])
def test_side_meter_counts_page_cache_written_after_start(tmp_path, use_cgroup):
    meter = memory.SideMeter([str(tmp_path)], use_cgroup=use_cgroup)
    try:
        meter.start()
        before = meter.peak()
        _write_in_child(tmp_path / "tier.bin")  # a child forked after start() is in the group too
        assert meter.peak() - before >= 60 * MIB, meter.method
    finally:
        meter.close()
    assert meter.group is None


def test_cgroup_is_made_and_removed_where_the_machine_allows():
    group = memory.Cgroup.create("unit")
    if group is None:
        assert memory.cgroup_method() == "rss+mincore"
        pytest.skip("no memory cgroup can be made here")
    try:
        assert os.path.isdir(group.path)
        assert group.peak() >= 0 and group.reset_peak() in (True, False)
    finally:
        group.remove()
    assert not os.path.exists(group.path)


def test_bench_command_compares_with_a_baseline(tmp_path, capsys):
    """`suite bench command`: both whole commands measured, the ratio from the two peaks, JSON written."""
    import json
    import shlex

    from lowmem.suite.cli import main

    touch = "b = bytearray({} << 20); b[::4096] = b'\\x01' * len(b[::4096])"
    out = tmp_path / "cmd.json"
    code = main(["bench", "command", "--json", str(out), "--baseline",
                 shlex.join([sys.executable, "-c", touch.format(160)]), "--", sys.executable, "-c", touch.format(16)])
    assert code == 0
    rows = {r["side"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["baseline"]["peak_MiB"] >= 150 and rows["command"]["peak_MiB"] < rows["baseline"]["peak_MiB"]
    assert rows["command"]["peak_vs_baseline"] == pytest.approx(rows["command"]["peak_MiB"] /
                                                                rows["baseline"]["peak_MiB"])
    assert "peak_vs_baseline" in capsys.readouterr().out
    assert main(["bench", "command", "--", sys.executable, "-c", "raise SystemExit(1)"]) == 1


def test_a_capped_command_keeps_page_cache_under_the_cap_and_is_killed_past_it(tmp_path):
    """`run_command(cap_bytes=...)`: writing 3x the cap through the page cache finishes under it (the kernel
    reclaims), holding 3x the cap in anonymous memory is killed and reported as such."""
    if memory.cgroup_method() == "rss+mincore":
        out = memory.run_command([sys.executable, "-c", "pass"], cap_bytes=96 * MIB, timeout=60)
        assert out["cap_enforced"] is False  # said, not pretended
        pytest.skip("no memory cgroup on this machine: a cap cannot be enforced")
    cap = 96 * MIB
    write = _WRITE.replace("range(64)", "range(288)")
    out = memory.run_command([sys.executable, "-c", write, str(tmp_path / "big.bin")], cap_bytes=cap, timeout=120)
    assert out["returncode"] == 0 and out["cap_enforced"] and out["oom_kills"] == 0, out
    assert (tmp_path / "big.bin").stat().st_size == 288 * MIB
    assert out["peak_bytes"] <= cap, out
    hold = "b = bytearray(288 << 20)\nb[::4096] = b'\\x01' * len(b[::4096])\n"
    out = memory.run_command([sys.executable, "-c", hold], cap_bytes=cap, timeout=120)
    assert out["returncode"] != 0 and out["oom_kills"] >= 1, out


def test_bench_command_runs_each_side_under_cap_gib_and_says_which_was_killed(tmp_path):
    """`suite bench command --cap_gib`: a baseline over the cap is killed and shown so (`oom_killed`), the command
    under it completes; the run exits 1 as any failed side makes it."""
    if memory.cgroup_method() == "rss+mincore":
        pytest.skip("no memory cgroup on this machine: a cap cannot be enforced")
    from lowmem.suite.cli import main

    hold = "b = bytearray(288 << 20); b[::4096] = b'\\x01' * len(b[::4096])"
    out = tmp_path / "rows.json"
    rc = main(["bench", "command", "--cap_gib", str(96 / 1024), "--json", str(out), "--baseline",
               f'{sys.executable} -c "{hold}"', "--", sys.executable, "-c", "pass"])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 1 and [(r["side"], r["oom_killed"]) for r in rows] == [("baseline", True), ("command", False)], rows
    assert rows[1]["returncode"] == 0 and rows[0]["returncode"] != 0


def test_step_seconds_reads_the_plain_loops_lines(tmp_path):
    from lowmem.suite.bench.harness import step_seconds

    plain = tmp_path / "plain.log"
    plain.write_text("noise\nplain step 1/3 s 10.5 loss 0.1\nplain step 2/3 s 4.25 loss 0.1\nplain step 3/3 s 4.75\n")
    assert step_seconds(plain.read_text()) == [10.5, 4.25, 4.75]


def test_csv_step_seconds_reads_the_runs_metrics(tmp_path):
    from lowmem.suite.bench.harness import csv_step_seconds

    assert csv_step_seconds(str(tmp_path), 1) == []
    (tmp_path / "logs" / "csv").mkdir(parents=True)
    (tmp_path / "logs" / "csv" / "metrics.csv").write_text(
        "epoch,images_per_s,lr,step,train_loss\n0,,1e-4,0,1.1\n0,0.0025,1e-4,1,1.4\n0,0.004,1e-4,2,1.2\n")
    assert csv_step_seconds(str(tmp_path), 2) == [800.0, 500.0]
