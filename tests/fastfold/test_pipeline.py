"""The fold flow on the tiny random model: precomputed alignments and templates, several models and their
ranking, resume after an interruption, overwrite, a failing target among good ones, Ray with several targets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.io.protein import from_pdb
from lowmem.fastfold.run import (
    AlignmentConfig,
    FoldConfig,
    ModelSpec,
    Prediction,
    Target,
    fold_targets,
    is_complete,
    read_targets,
)

ASSETS = Path(__file__).parents[1] / "assets" / "fold"
QUERY = read_targets(ASSETS / "query.fasta")[0]


def _config(out: Path, **kw) -> FoldConfig:
    models = kw.pop("models", [ModelSpec(model_name="model_1_ptm", tiny=True)])
    alignment = kw.pop("alignment", AlignmentConfig(single_sequence=True))
    return FoldConfig(output_dir=str(out), models=models, alignment=alignment, **kw)


def test_precomputed_alignments_templates_two_models(tmp_path):
    alignment = AlignmentConfig(
        precomputed_dir=str(ASSETS / "alignments"),
        template_mmcif_dir=str(ASSETS / "mmcifs"),
        max_template_date="2021-01-01",
    )
    models = [ModelSpec(model_name="model_1", tiny=True), ModelSpec(model_name="model_3", tiny=True, seed=1)]
    (result,) = fold_targets([QUERY], _config(tmp_path, models=models, alignment=alignment))
    assert result.status == "done", result.error
    folder = tmp_path / "query"
    ranking = json.loads((folder / "ranking.json").read_text())
    assert ranking["metric"] == "mean_plddt" and sorted(ranking["order"]) == ["model_1", "model_3"]
    scores = ranking["scores"]
    assert scores[ranking["order"][0]] >= scores[ranking["order"][1]]
    best = Prediction.load(folder / f"query_{ranking['order'][0]}_prediction.npz")
    conf = json.loads((folder / "query_confidence.json").read_text())
    assert conf["plddt"] == pytest.approx(best.plddt.tolist(), abs=0.01) and "pae" not in conf
    top = from_pdb((folder / "query_unrelaxed.pdb").read_text())
    np.testing.assert_allclose(top.b_factors[:, 1], best.plddt, atol=0.01)
    assert top.sequence == QUERY.sequence
    assert not (folder / "query_relaxed.pdb").exists() and not (folder / "query_pae.png").exists()
    assert is_complete(QUERY, tmp_path)
    # the MSA coverage plot as ColabFold draws it, listed with the target's files
    assert (folder / "query_coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "query_coverage.png" in json.loads((folder / "timings.json").read_text())["files"]


def test_resume_skip_and_overwrite(tmp_path):
    cfg = _config(tmp_path)
    target = Target("pep", "MKTAYIAKQRQISFVKSHFSRQ")
    (first,) = fold_targets([target], cfg)
    folder = tmp_path / "pep"
    assert first.status == "done" and (folder / "pep_pae.png").exists()
    record = json.loads((folder / "timings.json").read_text())
    assert "model_model_1_ptm" in record["timings"]
    assert fold_targets([target], cfg)[0].status == "skipped"

    (folder / "timings.json").unlink()  # as if killed after the model ran, before the outputs were done
    (folder / "pep_plddt.png").unlink()
    (resumed,) = fold_targets([target], cfg)
    assert resumed.status == "done" and (folder / "pep_plddt.png").exists()
    assert "model_model_1_ptm" not in json.loads((folder / "timings.json").read_text())["timings"]  # cached

    cfg.overwrite = True
    (again,) = fold_targets([target], cfg)
    assert again.status == "done"
    assert "model_model_1_ptm" in json.loads((folder / "timings.json").read_text())["timings"]


def test_a_failing_target_is_reported_and_the_others_go_on(tmp_path):
    alignments = tmp_path / "alignments"
    shutil.copytree(ASSETS / "alignments" / "query", alignments / "query")
    (alignments / "broken").mkdir()
    (alignments / "broken" / "bfd_uniref_hits.a3m").write_text(">q\nMKTAY\n>s\nMK\n")
    cfg = _config(tmp_path / "out", alignment=AlignmentConfig(precomputed_dir=str(alignments)))
    results = fold_targets([Target("broken", "MKTAY"), QUERY], cfg)
    assert [r.status for r in results] == ["failed", "done"]
    assert "record 2" in results[0].error and "bfd_uniref_hits.a3m" in results[0].error
    assert not is_complete(results[0].target, tmp_path / "out")


@pytest.mark.slow
def test_ray_several_targets_match_the_in_process_path(tmp_path):
    pytest.importorskip("ray")
    from lowmem.fastfold.relax import RelaxConfig

    targets = [Target(f"t{i}", seq) for i, seq in enumerate(["MKTAYIAK", "GSWLLKKA", "PEPTIDEK"])]
    ray_results = fold_targets(targets, _config(tmp_path / "ray", num_workers=2, relax=RelaxConfig(platform="CPU")))
    assert [r.status for r in ray_results] == ["done"] * 3, [r.error for r in ray_results]
    for t in targets:  # relaxed in Ray tasks
        record = json.loads((tmp_path / "ray" / t.name / "timings.json").read_text())
        assert (
            record["relax"]["violations_after"] == 0 and (tmp_path / "ray" / t.name / f"{t.name}_relaxed.pdb").exists()
        )
    (local,) = fold_targets(targets[1:2], _config(tmp_path / "local"))
    a = Prediction.load(tmp_path / "ray" / "t1" / "t1_model_1_ptm_prediction.npz")
    b = Prediction.load(tmp_path / "local" / "t1" / "t1_model_1_ptm_prediction.npz")
    np.testing.assert_allclose(a.positions, b.positions, atol=1e-5)
    assert local.status == "done"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_dap_ranks_match_one_process(tmp_path):
    pytest.importorskip("lowmem.fastfold.dap")
    target = Target("pep", "MKTAYIAKQRQISF")
    (one,) = fold_targets([target], _config(tmp_path / "one"))
    (two,) = fold_targets([target], _config(tmp_path / "two", devices=2))
    assert one.status == "done" and two.status == "done", two.error
    a = Prediction.load(tmp_path / "one" / "pep" / "pep_model_1_ptm_prediction.npz")
    b = Prediction.load(tmp_path / "two" / "pep" / "pep_model_1_ptm_prediction.npz")
    np.testing.assert_allclose(b.positions, a.positions, atol=1e-3)
    np.testing.assert_allclose(b.plddt, a.plddt, atol=1e-3)
    assert not (tmp_path / "two" / "pep" / ".dap_batch.npz").exists()
