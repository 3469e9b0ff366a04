"""`suite bench gpu` (issue 35): the whole command end to end on CPU at tiny sizes (`--device cpu --smoke`), a
crashed and a hung stage recorded while the next one still runs, the report's pieces; and, on a GPU, the kernels'
and Gemini's parity on the device (the `gpu` tests the command's first stage runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lowmem.suite.bench import gpu, gpu_workers, harness
from lowmem.suite.bench.gpu_stages import parse_pytest_summary


def _run(tmp_path, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the installed package, not the checkout's folders
    return subprocess.run([sys.executable, "-m", "lowmem.suite", "bench", "gpu", "--out", str(tmp_path / "out"),
                           *argv], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


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
        assert any(t["rows"] for t in stage["tables"].values()), name
        assert f"## {name}: ok" in md
    assert "## Stages" in md and "## Targets" in md
    assert all(t["met"] is None for t in payload["targets"])  # no target is judged on CPU


def test_smoke_records_the_pytest_stage_and_parity(smoke):
    _, _, stages = smoke
    tables = stages["checks"]["tables"]
    (row,) = tables["pytest"]["rows"]
    assert row["command"] == "pytest -m gpu tests/suite/test_bench_gpu.py" and row["outcome"] == "ok"
    assert row["skipped"] >= 3 and row["failed"] == 0  # this file's gpu tests, skipped without CUDA
    checks = [r["check"] for r in tables["parity"]["rows"]]
    assert sum(c.startswith("kernels") for c in checks) == 10 and sum(c.startswith("gemini") for c in checks) == 3
    assert all(r["ok"] for r in tables["parity"]["rows"])


def test_smoke_rows_measure_both_sides(smoke):
    _, _, stages = smoke
    kernels = stages["kernels"]["tables"]["kernels"]["rows"]
    assert kernels and all("time ratio" in r for r in kernels)
    sd = stages["sd"]["tables"]["sd"]["rows"]
    assert {(r["variant"], r["batch"]) for r in sd if r["outcome"] == "ok"} >= {("plain", 1), ("ours", 1)}
    gem = stages["gemini"]["tables"]
    assert {r["strategy"] for r in gem["gemini"]["rows"]} == {"gemini", "fsdp2"}
    assert gem["gemini_detail"]["rows"] and gem["gemini_tier"]["rows"][0]["samples_per_s"] > 0
    fold = stages["fold"]["tables"]["fold"]["rows"]
    assert [(r["n_res"], r["chunks"], r["outcome"]) for r in fold] == [(16, "none", "ok"), (16, "auto", "ok"),
                                                                      (16, "4", "ok"), (24, "auto", "ok")]


def test_a_crashed_and_a_hung_stage_are_recorded_and_the_next_stage_runs(tmp_path):
    done = _run(tmp_path, "--device", "cpu", "--smoke", "--rows", "checks,kernels,sd",
                "--_inject", "checks=crash,kernels=hang,sd=ok", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    payload, md = _report(tmp_path)
    status = {s["name"]: s["status"] for s in payload["stages"]}
    assert status == {"checks": "crashed", "kernels": "timed out", "sd": "ok"}
    stages = {s["name"]: s for s in payload["stages"]}
    assert "injected hang" in stages["kernels"]["notes"][0]  # what a killed stage recorded is kept
    assert stages["sd"]["tables"]["injected"]["rows"] == [{"stage": "sd", "ok": True}]
    assert "| checks | crashed |" in md and "| kernels | timed out |" in md


def test_a_stage_without_time_is_skipped(tmp_path):
    done = _run(tmp_path, "--device", "cpu", "--smoke", "--rows", "fold", "--budget-s", "2", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    payload, _ = _report(tmp_path)
    (stage,) = payload["stages"]
    assert stage["status"] == "skipped" and "needs at least 5 s" in stage["reason"]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    done = _run(tmp_path, "--device", "cpu", timeout=60)
    assert done.returncode == 2 and "--device cpu runs only with --smoke" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_pytest_summary_counts():
    text = "..s\nFAILED tests/x.py::t - boom\n1 failed, 3 passed, 2 skipped, 950 deselected, 1 error in 9.12s\n"
    counts = parse_pytest_summary(text)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["deselected"], counts["errors"]) == (
        3, 1, 2, 950, 1)
    assert parse_pytest_summary("no tests ran in 0.01s")["passed"] == 0


def test_markdown_marks_missed_targets_and_escapes_cells():
    payload = {"device": "cuda", "budget_s": 420, "elapsed_s": 10, "finished": True, "machine": {},
               "stages": [{"name": "fold", "what": "w", "status": "ok", "seconds": 1.0, "slice_s": 80,
                           "tables": {"fold": {"title": "t", "rows": [{"a": 1.23456, "b": "x|y", "c": False}]}},
                           "notes": ["n"], "targets": []}],
               "targets": [{"stage": "fold", "target": "T", "measured": "1.5", "met": False}]}
    md = gpu.markdown(payload)
    assert "| fold | T | 1.5 | **missed** |" in md and "| 1.235 | x\\|y | **no** |" in md and "- n" in md


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


# ---- on a GPU: run by `suite bench gpu`'s first stage (pytest -m gpu) ------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_match_float64_on_cuda_with_triton_compiled(dtype):
    rows = list(gpu_workers.kernel_parity("cuda", dtype))
    bad = [r for r in rows if not r["ok"] or r.get("path") != "triton compiled"]
    assert not bad, bad


@pytest.mark.gpu
def test_gemini_matches_torch_adamw_on_cuda():
    rows = gpu_workers.gemini_parity("cuda")
    assert all(r["ok"] for r in rows), rows
