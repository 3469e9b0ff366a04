"""The feature workflow (`--enable_workflow`): each target's searches as parallel Ray tasks give the same raw
features as the serial path, on small databases in the real formats (FASTA for jackhmmer, HH-suite ffindex
databases for HHblits and HHsearch) that the test writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.data import testing as fold_dbs
from lowmem.fastfold.data.searches import search_jobs, tool_cpus
from lowmem.fastfold.run import AlignmentConfig, FoldConfig, ModelSpec, Target, feature_stream
from lowmem.fastfold.run.stages import FEATURE_INFO


def test_cpu_shares_and_the_search_plan(tmp_path):
    assert [tool_cpus(8, 3), tool_cpus(2, 3), tool_cpus(12, 3), tool_cpus(4, 0)] == [2, 1, 4, 4]
    cfg = AlignmentConfig(uniref90_database_path="u.fasta", mgnify_database_path="m.fasta", bfd_database_path="bfd",
                          uniref30_database_path="ur30", pdb70_database_path="pdb70")
    jobs = search_jobs("MKTAY", cfg, tmp_path)
    assert [(j.tool, j.name, j.databases, j.after) for j in jobs] == [
        ("jackhmmer", "uniref90_hits.sto", ("u.fasta",), None), ("jackhmmer", "mgnify_hits.sto", ("m.fasta",), None),
        ("hhblits", "bfd_uniref_hits.a3m", ("bfd", "ur30"), None),
        ("hhsearch", "pdb70_hits.hhr", ("pdb70",), "uniref90_hits.sto")]
    (tmp_path / "mgnify_hits.sto").write_text("cached")  # a result in place is not searched again
    assert [j.name for j in search_jobs("MKTAY", cfg, tmp_path)] == ["uniref90_hits.sto", "bfd_uniref_hits.a3m",
                                                                     "pdb70_hits.hhr"]
    no_uniref = AlignmentConfig(mgnify_database_path="m.fasta", pdb70_database_path="pdb70")
    assert [j.name for j in search_jobs("MKTAY", no_uniref, tmp_path / "x")] == ["mgnify_hits.sto"]  # no hhsearch input


@pytest.fixture(scope="module")
def databases(tmp_path_factory):
    if shutil.which("jackhmmer") is None:
        pytest.skip("jackhmmer is not installed")
    rng = np.random.default_rng(3)
    queries = [(f"q{i}", "".join(rng.choice(fold_dbs.LETTERS, 36))) for i in range(2)]
    folder = tmp_path_factory.mktemp("dbs")
    missing = fold_dbs.hhsuite_missing() if shutil.which("hhblits") and shutil.which("hhsearch") else "hhblits"
    dbs = fold_dbs.build_databases(folder, queries, per_family=6, decoy_count=40, hhsuite=not missing)
    return [Target(n, s) for n, s in queries], dbs, missing


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _stream(targets, out: Path, alignment: AlignmentConfig, **kw) -> dict[str, dict]:
    cfg = FoldConfig(output_dir=str(out), models=[ModelSpec(model_name="model_1_ptm", tiny=True)],
                     alignment=alignment, **kw)
    got = {}
    for target, raw, _seconds in feature_stream(targets, cfg, with_templates=False):
        assert not isinstance(raw, BaseException), raw
        got[target.name] = raw
    return got


def test_workflow_features_equal_the_serial_path(databases, ray_local, tmp_path):
    targets, dbs, missing = databases
    alignment = AlignmentConfig(**dbs, cpus=2)
    serial = _stream(targets, tmp_path / "serial", alignment)
    workflow = _stream(targets, tmp_path / "workflow", alignment, enable_workflow=True)
    expected = ["uniref90_hits.sto", "mgnify_hits.sto"] + ([] if missing else ["bfd_uniref_hits.a3m"])
    for t in targets:
        a, b = serial[t.name], workflow[t.name]
        info = b.pop(FEATURE_INFO)
        a.pop(FEATURE_INFO)
        assert sorted(a) == sorted(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
        rows = {f["file"]: f["rows_used"] for f in info["alignment_files"]}
        assert sorted(rows) == sorted(expected) and all(r > 1 for r in rows.values()), rows  # every search hit
        assert a["msa"].shape[0] > 6
        for name in expected + ([] if missing else ["pdb70_hits.hhr"]):
            assert (tmp_path / "workflow" / t.name / "msas" / name).is_file(), name
    if missing:
        pytest.skip(f"HHblits/HHsearch part not checked: an HH-suite database cannot be built here ({missing})")


def test_a_failing_search_fails_its_target_with_the_tools_message(databases, ray_local, tmp_path):
    from lowmem.fastfold.data.tools import ToolError

    targets, dbs, _ = databases
    alignment = AlignmentConfig(uniref90_database_path=dbs["uniref90_database_path"],
                                mgnify_database_path=dbs["mgnify_database_path"], cpus=2)
    cfg = FoldConfig(output_dir=str(tmp_path), models=[ModelSpec(model_name="model_1_ptm", tiny=True)],
                     alignment=alignment, enable_workflow=True)
    cfg.alignment.jackhmmer_binary_path = str(tmp_path / "no_jackhmmer")
    got = list(feature_stream(targets, cfg, with_templates=False))
    assert sorted(t.name for t, _, _ in got) == sorted(t.name for t in targets)
    for _, exc, _ in got:
        assert isinstance(exc, ToolError) and "no_jackhmmer" in str(exc), exc
    assert not any((tmp_path / t.name / "msas" / "uniref90_hits.sto").exists() for t in targets)


def test_enable_workflow_flag_runs_the_workflow(databases, ray_local, tmp_path, monkeypatch):
    from lowmem.fastfold.run import pipeline
    from lowmem.suite.cli import main

    targets, dbs, _ = databases
    calls = []
    real = pipeline.workflow_stream
    monkeypatch.setattr(pipeline, "workflow_stream", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    fasta = tmp_path / "one.fasta"
    fasta.write_text(f">{targets[0].name}\n{targets[0].sequence}\n")
    out = tmp_path / "out"
    code = main(["fold", str(fasta), "--output_dir", str(out), "--no-relax", "--enable_workflow",
                 "--uniref90_database_path", dbs["uniref90_database_path"],
                 "--mgnify_database_path", dbs["mgnify_database_path"]])
    assert code == 0 and [[t.name for t in c] for c in calls] == [[targets[0].name]]
    msas = out / targets[0].name / "msas"
    assert (msas / "uniref90_hits.sto").is_file() and (msas / "mgnify_hits.sto").is_file()
    assert (out / targets[0].name / "timings.json").is_file()
