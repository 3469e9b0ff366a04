from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lowmem.suite.cli import COMMANDS, main


def _run(*argv):
    return subprocess.run([sys.executable, "-m", "lowmem.suite", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})


def test_help_lists_subcommands():
    out = _run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("argv", [["nosuch"], ["env", "--no-such-flag"], ["--bogus"]])
def test_bad_input_is_one_line_exit_2(argv):
    out = _run(*argv)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "error" in lines[0]


def test_env_json(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["packages"]["torch"] != "not installed"
    assert info["distributed"]["gloo"] is True
    assert set(info["kernel_backends"])  # one entry per kernel (or the reason there is none)


def test_env_text(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "triton", "diffusers", "lightning", "ray", "openmm", "gloo", "kernel backends"):
        assert word in out


@pytest.mark.distributed
def test_bench_collectives_writes_both_paths(tmp_path):
    from lowmem.core_parallel.host_comm import host_collectives_supported

    if not host_collectives_supported():
        pytest.skip("host collectives need x86-64 Linux with /dev/shm")
    path = tmp_path / "c.json"
    out = _run("bench", "collectives", "--mb", "0.05", "--repeat", "2", "--warmup", "1", "--json", str(path))
    assert out.returncode == 0, out.stderr
    rows = json.loads(path.read_text())["rows"]
    assert [(r["op"], r["MiB"]) for r in rows] == [("all_gather", 0.05), ("reduce_scatter", 0.05)]
    for r in rows:
        assert r["gloo_ms"] > 0 and r["host_ms"] > 0
        assert r["host_vs_gloo"] == pytest.approx(r["host_ms"] / r["gloo_ms"], rel=1e-9)
    assert "host_vs_gloo" in out.stdout


def test_bench_collectives_bad_sizes_exit_2():
    out = _run("bench", "collectives", "--mb", "4,x")
    assert out.returncode == 2 and "--mb" in out.stderr
