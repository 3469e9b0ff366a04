"""`suite bench fold-model --multimer` (issue 22): one tiny run writes both comparisons (chunked vs unchunked,
DAP 2 ranks vs 1) with ratios from that run; bad settings are one line, exit 2. Timings are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "lowmem.suite", "bench", "fold-model", *argv], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONSAFEPATH": "1"})


@pytest.mark.distributed
def test_multimer_bench_writes_both_comparisons(tmp_path):
    path = tmp_path / "m.json"
    out = _run("--multimer", "--chains", "9,6", "--blocks", "1", "--template_blocks", "1", "--n_seq", "4",
               "--n_extra", "4", "--n_templ", "1", "--repeat", "1", "--warmup", "0", "--chunk_size", "4",
               "--json", str(path))
    assert out.returncode == 0, out.stderr
    result = json.loads(path.read_text())
    assert result["benchmark"] == "fold-model --multimer"
    rows = {r["comparison"]: r for r in result["rows"]}
    assert set(rows) == {"chunked vs unchunked", "DAP 2 ranks vs 1"}
    for row in rows.values():
        assert row["complex"] == "9+6"
        assert row["time_ratio"] == pytest.approx(row["s"] / row["baseline_s"], rel=1e-9)
        assert row["memory_ratio"] == pytest.approx(row["peak_mib"] / row["baseline_peak_mib"], rel=1e-6)
    assert "DAP 2 ranks vs 1" in out.stdout


@pytest.mark.parametrize("argv", [
    ["--multimer", "--chains", "9,x"],
    ["--multimer", "--n_templ", "0"],
    ["--multimer", "--parts", "dap", "--dap_ranks", "2"],
])
def test_multimer_bench_bad_settings_exit_2(argv):
    out = _run(*argv)
    assert out.returncode == 2
    assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr
