"""The bench harness itself (`suite.bench.harness`): a side run as a process under a memory cap and a time limit,
its JSON lines and per-step times read back, ratios against a baseline, and what `publish` writes (the printed
tables with every row, the JSON read back, the Markdown tables, the plot)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pytest

from lowmem.suite.bench import harness
from lowmem.utils.memory_meter import cgroup_method

MIB = 2**20
_HOLD = "b = bytearray({mib} << 20)\nb[::4096] = b'\\x01' * len(b[::4096])\nprint('held', flush=True)\n"


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_side_over_its_cap_is_killed_and_reported():
    if cgroup_method() == "rss+mincore":
        pytest.skip("no memory cgroup can be made here: a cap cannot be enforced")
    small = harness.run_side(harness.Side("small", _py(_HOLD.format(mib=32)), cap_bytes=160 * MIB, timeout=60))
    assert small.returncode == 0 and not small.oom_killed and small.outcome() == "ok"
    assert 32 * MIB <= small.peak_bytes <= 160 * MIB and small.method.startswith("cgroup")
    big = harness.run_side(harness.Side("big", _py(_HOLD.format(mib=256)), cap_bytes=160 * MIB, timeout=60))
    assert big.returncode != 0 and big.oom_killed and big.outcome() == "killed for memory"
    assert "held" not in big.stdout
    row = big.row()
    assert row["oom_killed"] and row["cap_mib"] == 160 and row["peak_mib"] <= 160


@pytest.mark.parametrize("measure", [True, False], ids=["measured", "unmeasured"])
def test_a_side_past_its_time_limit_is_ended_with_what_it_started(tmp_path, measure):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('started', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    got = harness.run_side(harness.Side("hang", _py(code), timeout=3, measure=measure))
    assert time.monotonic() - t0 < 30
    assert got.timed_out and got.outcome().startswith("killed at its time limit")
    assert "started" in got.stdout  # what it printed before the limit is kept
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the side's own child survived the time limit")


def test_json_lines_step_times_and_a_failed_result(tmp_path):
    code = ("import json\nfrom lowmem.suite.bench.harness import log_step\n"
            "print('noise')\nlog_step(0, 2, 1.5, 0.25)\nlog_step(1, 2, 0.5, 0.125)\n"
            "print(json.dumps({'a': 1}))\nprint(json.dumps({'a': 2}))\n")
    got = harness.run_side(harness.Side("ok", _py(code), measure=False))
    assert harness.json_lines(got.stdout) == [{"a": 1}, {"a": 2}] and got.result() == {"a": 2}
    assert got.step_times() == [1.5, 0.5]
    logged = harness.run_side(harness.Side("ok", _py(code), log=str(tmp_path / "side.log")))
    assert logged.step_times() == [1.5, 0.5] and logged.peak_bytes > 0
    bad = harness.run_side(harness.Side("the bad side", _py("import sys; sys.exit('no such file: x')")))
    with pytest.raises(RuntimeError, match="the bad side failed \\(exit 1\\)(.|\n)*no such file: x"):
        bad.result()


def test_step_times_time_each_step_but_not_what_runs_before_it():
    calls = []
    times = harness.step_times(lambda: (calls.append("step"), time.sleep(0.02)), 3, warmup=1,
                               before=lambda: (calls.append("before"), time.sleep(0.2)))
    assert calls == ["before", "step"] * 4 and len(times) == 3
    assert all(0.015 < t < 0.15 for t in times), times


def test_ratios_against_a_baseline():
    rows = [{"name": "base", "s": 2.0, "mib": 100.0}, {"name": "ours", "s": 1.0, "mib": 25.0},
            {"name": "failed", "s": "n/a"}]
    harness.add_ratios(rows, rows[0], {"time_ratio": "s", "mem_ratio": "mib"})
    assert [r["time_ratio"] for r in rows] == [1.0, 0.5, None]
    assert [r["mem_ratio"] for r in rows] == [1.0, 0.25, None]
    harness.add_ratios(rows, None, {"x": "s"}, default=float("nan"))
    assert all(r["x"] != r["x"] for r in rows)
    assert harness.ratio(1.0, 0.0) is None and harness.ratio(None, 1.0, "d") == "d"


def test_flag_types():
    assert harness.int_list("256, 512") == [256, 512] and harness.count("1.5B") == 1_500_000_000
    assert harness.count("100K") == 100_000 and harness.names(("a", "b"))("b,a") == ["b", "a"]
    for parse, text in ((harness.int_list, "1,x"), (harness.int_list, "0"), (harness.count, "lots"),
                        (harness.names(("a",)), "a,c")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_publish_prints_every_row_and_writes_json_markdown_and_plot(tmp_path, capsys):
    rows = [{"side": f"s{i}", "peak_mib": 10.0 * (i + 1), "peak_ratio": i + 1.0, "ok": i % 2 == 0, "cell": "a|b"}
            for i in range(7)]
    notes = ["method: test"]
    paths = {k: str(tmp_path / f"out.{k}") for k in ("json", "md", "png")}
    args = argparse.Namespace(json=paths["json"], markdown=paths["md"], plot=paths["png"])
    harness.publish(args, {"benchmark": "t", "rows": rows}, [("the title", rows, ["side", "peak_mib", "missing",
                                                                                  "peak_ratio", "ok", "cell"])], notes)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "the title" and out[1].split() == ["side", "peak_mib", "peak_ratio", "ok", "cell"]
    assert [line.split()[0] for line in out[3:10]] == [f"s{i}" for i in range(7)] and out[10] == notes[0]
    assert "70.000" in out[9]
    back = json.loads(open(paths["json"]).read())
    assert back["benchmark"] == "t" and back["rows"] == rows and "date" in back["machine"]
    md = open(paths["md"]).read().splitlines()
    assert "| side | peak_mib | peak_ratio | ok | cell |" in md
    assert [line.split()[1] for line in md if line.startswith("| s") and "peak_mib" not in line] == [
        f"s{i}" for i in range(7)]
    assert "| s1 | 20.000 | 2.000 | **no** | a\\|b |" in md
    assert md[-1] == "- method: test"
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_output_files_without_flags(tmp_path, capsys):
    harness.publish(argparse.Namespace(json=None, markdown=None, plot=None), {"benchmark": "t"},
                    [("empty", [], None)])
    assert capsys.readouterr().out == "empty\n(no rows)\n" and not os.listdir(tmp_path)
