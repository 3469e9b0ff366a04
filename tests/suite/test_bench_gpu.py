"""`suite bench gpu` (issue 35): the whole command end to end on CPU at tiny sizes (`--device cpu --smoke`: every
stage's commands run and their rows reach gpu.json and gpu.md), a crashed and a hung stage recorded while the next
one still runs, SIGTERM, the report's pieces. The GPU checks themselves are tests/kernels/test_gpu_parity.py and
tests/core_parallel/test_gpu_parity.py (`pytest -m gpu`, the command's first stage)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lowmem.suite.bench import gpu, harness


def _argv(tmp_path, *argv: str) -> list[str]:
    return [sys.executable, "-m", "lowmem.suite", "bench", "gpu", "--out", str(tmp_path / "out"), *argv]


def _run(tmp_path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the installed package, not the checkout's folders
    return subprocess.run(_argv(tmp_path, *argv), capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env=env)


def _report(tmp_path) -> tuple[dict, str]:
    out = tmp_path / "out"
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-smoke")
    done = _run(tmp, "--device", "cpu", "--smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload, md = _report(tmp)
    return payload, md, {s["name"]: s for s in payload["stages"]}


def test_smoke_runs_every_stage_and_writes_json_and_markdown(smoke):
    payload, md, stages = smoke
    assert payload["finished"] and list(stages) == [s.name for s in gpu.STAGES]
    assert {s["status"] for s in payload["stages"]} == {"ok"}, [(s["name"], s.get("reason")) for s in stages.values()]
    for name, stage in stages.items():
        assert stage["commands"] and all(c["outcome"] == "ok" for c in stage["commands"]), stage["commands"]
        assert any(t["rows"] for t in stage["tables"].values()), name
        assert f"## {name}: ok" in md
    assert "## Stages" in md and "## Targets" in md and "| suite bench fold-model --n_res 16 " in md
    assert {t["stage"] for t in payload["targets"]} == set(stages)
    assert all(t["met"] is None for t in payload["targets"])  # no target is judged on CPU


def test_smoke_checks_run_the_gpu_parity_tests(smoke):
    _, _, stages = smoke
    (row,) = stages["checks"]["tables"]["pytest"]["rows"]
    assert (row["passed"], row["failed"], row["errors"], row["skipped"]) == (0, 0, 0, 13)  # skipped without CUDA
    assert "pytest -q -m gpu" in stages["checks"]["commands"][0]["command"]


def test_smoke_rows_measure_both_sides_and_feed_the_targets(smoke):
    payload, _, stages = smoke
    kernels = stages["kernels"]["tables"]["kernels"]["rows"]
    assert kernels and all("time ratio" in r for r in kernels)
    sd = stages["sd"]["tables"]["sd"]["rows"]
    assert [(r["batch"], r["variant"].split()[0]) for r in sd] == [(1, "plain"), (1, "ours")]
    gem = stages["gemini"]["tables"]
    (row,) = gem["gemini"]["rows"]  # smoke: Gemini alone with the CPU tier's flags (on CUDA: two commands)
    assert row["strategy"] == "gemini" and row["samples_per_s"] > 0 and "states_GiB" in row
    assert [r["n_res"] for r in stages["fold"]["tables"]["fold"]["rows"]] == [16]
    measured = {t["target"]: t["measured"] for t in payload["targets"]}
    unmeasured = {t for t, m in measured.items() if m == "not measured"}
    not_in_smoke = ("softmax", "attention", "DDP", "FSDP2", "24 GiB with", "CPU tier")
    assert all(any(w in t for w in not_in_smoke) for t in unmeasured), unmeasured
    assert not any(m.startswith("not judged") for m in measured.values()), measured


def test_a_crash_a_hang_and_sigterm_are_recorded_while_the_next_stage_runs(tmp_path):
    argv = _argv(tmp_path, "--device", "cpu", "--smoke", "--rows", "checks,kernels,sd,gemini",
                 "--_inject", "checks=crash,kernels=hang,sd=ok,gemini=hang")
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    log, deadline = tmp_path / "out" / "gpu.log", time.monotonic() + 60
    while "$ python" not in (log.read_text() if log.exists() else "").partition("stage gemini")[2]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the device call's limit, while gemini hangs
    assert proc.wait(timeout=30) == 0
    payload, md = _report(tmp_path)
    stages = {s["name"]: s for s in payload["stages"]}
    assert {k: s["status"] for k, s in stages.items()} == {"checks": "crashed", "kernels": "timed out", "sd": "ok",
                                                           "gemini": "stopped"}
    assert stages["checks"]["reason"].startswith("exit code 3")
    assert stages["kernels"]["commands"][0]["outcome"].startswith("killed at its time limit")
    assert stages["sd"]["tables"]["injected"]["rows"] == [{"injected": True}] and stages["checks"]["tables"] == {}
    assert "| checks | crashed |" in md and "| kernels | timed out |" in md and "| gemini | stopped |" in md
    assert not payload["finished"] and payload["stopped"].startswith("SIGTERM")


def test_a_stage_without_time_is_skipped(tmp_path):
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    out = tmp_path / "out"
    assert gpu.run(parser.parse_args(["--out", str(out), "--device", "cpu", "--smoke", "--rows", "fold",
                                      "--budget-s", "2"])) == 0
    (stage,) = json.loads((out / "gpu.json").read_text())["stages"]
    assert stage["status"] == "skipped" and "needs at least 5 s" in stage["reason"]


def test_one_pass_reads_the_fold_model_child_line():
    line = '{"n_res": 24, "variant": "chunked", "seconds": 4.4, "peak_bytes": 7864320, "device": "cpu"}'
    assert gpu._one_pass(f"warning\n{line}\n") == [{"seconds": 4.4, "peak_mib": 7.5}] and gpu._one_pass("") == []


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    done = _run(tmp_path, "--device", "cpu", timeout=60)
    assert done.returncode == 2 and "--device cpu runs only with --smoke" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_targets_are_judged_from_the_rows_on_a_full_cuda_run_only():
    def stage(name, **tables):
        return {"name": name, "tables": {k: {"title": k, "rows": rows} for k, rows in tables.items()}}

    cuda, smoke = argparse.Namespace(device="cuda", smoke=False), argparse.Namespace(device="cuda", smoke=True)
    gemini = stage("gemini", gemini=[{"strategy": "gemini", "train_peak_MiB": 3274.1, "step_s": 0.512},
                                     {"strategy": "fsdp2", "train_peak_MiB": 3156.3, "step_s": 0.881}])
    got = {t["target"].split(":")[-1].strip(): (t["measured"], t["met"]) for t in gpu._judge(gemini, cuda)}
    assert got["peak <= 1.0x"] == ("1.037", False) and got["step <= 1.1x"] == ("0.581", True)
    assert all(t["met"] is None for t in gpu._judge(gemini, smoke))
    sd = stage("sd", sd=[{"batch": 1, "variant": "plain loop", "train_mib": 20000.0, "peak_mib": 21000.0},
                         {"batch": 1, "variant": "ours (...)", "train_mib": 3000.0, "peak_mib": 7000.0}])
    assert [t["met"] for t in gpu._judge(sd, cuda)] == [True, True, None]
    fold = stage("fold", fold=[{"n_res": 512, "time_ratio": 1.2}, {"n_res": 1024, "time_ratio": 1.4}],
                 fold_passes=[{"n_res": 2048, "card": "24 GiB", "peak_mib": 9000.0}])
    assert [(t["measured"], t["met"]) for t in gpu._judge(fold, cuda)] == [
        ("1.20 (N_res 512), 1.40 (N_res 1024)", False), ("largest that fit: 2048", True)]
    checks = stage("checks", pytest=[{"passed": 12, "failed": 1, "errors": 0, "skipped": 0, "failing": "t::x"}])
    assert [t["met"] for t in gpu._judge(checks, cuda)] == [False]
    assert [t["measured"] for t in gpu._judge(stage("kernels"), cuda)] == ["not measured"] * 4


def test_markdown_marks_missed_targets_and_escapes_cells():
    payload = {"device": "cuda", "budget_s": 420, "elapsed_s": 10, "finished": True, "machine": {},
               "stages": [{"name": "fold", "what": "w", "status": "ok", "seconds": 1.0, "slice_s": 80,
                           "tables": {"fold": {"title": "t", "rows": [{"a": 1.23456, "b": "x|y", "c": False}]}},
                           "notes": ["n"], "targets": [], "commands": [{"command": "suite bench x", "outcome": "ok"}]}],
               "targets": [{"stage": "fold", "target": "T", "measured": "1.5", "met": False}]}
    md = gpu.markdown(payload)
    assert "| fold | T | 1.5 | **missed** |" in md and "| 1.235 | x\\|y | **no** |" in md and "- n" in md
    assert "| suite bench x | ok |" in md


@pytest.mark.parametrize("lead", [[1, 2], [1, 3, 2]], ids=["sd", "evoformer"])
def test_floor_baseline_runs_forward_and_backward(lead):
    from lowmem.suite.bench import kernels as bench

    case = {"op": "attention", "size": "t", "mode": "fwd+bwd", "q": lead + [5, 8], "k": lead + [7, 8],
            "bias": [1] * (len(lead) - 1) + [2, 5, 7], "mask": [1] * len(lead) + [1, 7]}
    got = bench._worker({"case": case, "impl": "sdpa-nobias", "device": "cpu", "dtype": "float32", "repeat": 1,
                         "measure": "time"})
    assert got["ms"] > 0


def test_emulated_card_is_a_no_op_on_cpu():
    assert harness.emulate_card(8, torch.device("cpu")) == "no 8 GiB cap on cpu"
    assert harness.emulate_card(None, torch.device("cpu")) == ""


def test_emulated_card_caps_the_allocator_and_reports_the_smaller_card(monkeypatch):
    gib, fractions = 2**30, []

    class Props:
        total_memory = 80 * gib

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    note = harness.emulate_card(24, torch.device("cuda", 0))
    assert fractions == [0.3] and "emulated 24 GiB card" in note
    assert torch.cuda.mem_get_info(0) == (21 * gib, 24 * gib)  # what fastfold's auto chunks size themselves by
    assert harness.emulate_card(100, torch.device("cuda", 0)).startswith("the card has 80.0 GiB")
