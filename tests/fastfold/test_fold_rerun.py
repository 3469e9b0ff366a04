"""A rerun never serves a stale result (issue 21): a finished target is reused only when everything that made
it is the same; otherwise it is redone and the result says what changed. Also the everyday outputs: several
seeds per model, every model's files, AlphaFold's ranking_debug.json, recycles, B-factors as 100 - pLDDT."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.io.protein import from_pdb
from lowmem.fastfold.run import (
    AlignmentConfig,
    ModelSpec,
    Prediction,
    Target,
    fold_targets,
    is_complete,
    target_fingerprint,
)
from tests.fastfold.test_pipeline import _config


@pytest.fixture
def params(tmp_path):
    import torch

    from lowmem.fastfold.model import AlphaFold, config
    from lowmem.fastfold.params import save_params

    torch.manual_seed(5)
    path = tmp_path / "params_model_1_ptm.npz"
    save_params(AlphaFold(config.tiny()), path)
    return path


def test_changed_inputs_redo_the_target_and_say_what_changed(tmp_path, params):
    out = tmp_path / "out"
    target = Target("pep", "MKTAYIAKQR")
    (first,) = fold_targets([target], _config(out))
    assert first.status == "done"
    cache = out / "pep" / "pep_model_1_ptm_prediction.npz"
    random = Prediction.load(cache)
    (again,) = fold_targets([target], _config(out))
    assert again.status == "skipped" and again.note == "same inputs as the finished run"

    # the case: a first try without weights, then the real parameters
    with_params = [ModelSpec(model_name="model_1_ptm", param_path=str(params))]
    (real,) = fold_targets([target], _config(out, models=with_params))
    assert real.status == "done" and "models/parameters changed" in real.note
    assert not np.allclose(Prediction.load(cache).positions, random.positions)  # the cache was not reused
    assert "RANDOM" not in (out / "pep" / "pep_unrelaxed.pdb").read_text()
    assert fold_targets([target], _config(out, models=with_params))[0].status == "skipped"

    params.write_bytes(params.read_bytes() + b"\0")  # same name, other content
    (touched,) = fold_targets([target], _config(out, models=with_params))
    assert touched.status == "done" and "models/parameters" in touched.note

    shorter = Target("pep", "MKTAYIAK")
    (redone,) = fold_targets([shorter], _config(out, models=with_params))
    assert redone.status == "done" and redone.note == "redone: sequence changed"
    assert from_pdb((out / "pep" / "pep_unrelaxed.pdb").read_text()).sequence == "MKTAYIAK"

    for kw, label in [({"seed": 1}, "seed"), ({"num_recycle": 0}, "recycles"), ({"subtract_plddt": True},
                                                                                 "B-factors")]:
        (r,) = fold_targets([shorter], _config(out, models=with_params, **kw))
        assert r.status == "done" and label in r.note, (kw, r.note)


def test_a_changed_alignment_file_redoes_the_target(tmp_path):
    alignments = tmp_path / "alignments" / "pep"
    alignments.mkdir(parents=True)
    a3m = alignments / "bfd_uniref_hits.a3m"
    a3m.write_text(">pep\nMKTAYIAK\n>h\nMKTAhYIAR\n")
    cfg = _config(tmp_path / "out", alignment=AlignmentConfig(precomputed_dir=str(tmp_path / "alignments")))
    target = Target("pep", "MKTAYIAK")
    assert fold_targets([target], cfg)[0].status == "done"
    assert fold_targets([target], cfg)[0].status == "skipped"
    a3m.write_text(">pep\nMKTAYIAK\n>h\nMKTAhYIAR\n>g\nMKSAYIAK\n")
    (r,) = fold_targets([target], cfg)
    assert r.status == "done" and r.note == "redone: alignments changed"
    assert json.loads((tmp_path / "out" / "pep" / "features.json").read_text())["msa_depth_dedup"] == 3


def test_an_interrupted_redo_leaves_no_old_outputs_that_look_current(tmp_path, monkeypatch):
    out = tmp_path / "out"
    fold_targets([Target("pep", "MKTAYIAKQR")], _config(out))
    import lowmem.fastfold.run.stages as stages

    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(stages, "predict", boom)  # where the model stage calls it
    (r,) = fold_targets([Target("pep", "MKTAYIAK")], _config(out))
    assert r.status == "failed"
    assert not (out / "pep" / "pep_unrelaxed.pdb").exists() and not (out / "pep" / "timings.json").exists()
    assert not is_complete(Target("pep", "MKTAYIAKQR"), out)


def test_fingerprint_leaves_out_where_relax_runs_but_not_what_it_does():
    from lowmem.fastfold.relax import RelaxConfig

    t = Target("pep", "MKTAYIAK")
    cpu = target_fingerprint(t, _config(Path("o"), relax=RelaxConfig(platform="CPU")))
    auto = target_fingerprint(t, _config(Path("o"), relax=RelaxConfig(platform="auto")))
    other = target_fingerprint(t, _config(Path("o"), relax=RelaxConfig(platform="CPU", stiffness=5.0)))
    assert cpu == auto and cpu != other and target_fingerprint(t, _config(Path("o")))["relax"] is None


def test_seeds_models_and_ranking_debug(tmp_path):
    models = [ModelSpec(model_name="model_1_ptm", tiny=True), ModelSpec(model_name="model_3_ptm", tiny=True, seed=1)]
    (r,) = fold_targets([Target("pep", "MKTAYIAKQR")], _config(tmp_path, models=models, num_seeds=2, seed=4))
    assert r.status == "done", r.error
    folder = tmp_path / "pep"
    labels = [f"{m}_seed_{s}" for m in ("model_1_ptm", "model_3_ptm") for s in (4, 5)]
    for label in labels:  # every prediction gets its structure, confidence and plots
        for suffix in ("_unrelaxed.pdb", "_unrelaxed.cif", "_confidence.json", "_plddt.png", "_pae.png",
                       "_prediction.npz"):
            assert (folder / f"pep_{label}{suffix}").exists(), label + suffix
    debug = json.loads((folder / "ranking_debug.json").read_text())
    assert sorted(debug["order"]) == sorted(labels) and set(debug["plddts"]) == set(labels)
    plddts = debug["plddts"]  # AlphaFold ranks monomer models (`_ptm` too) by mean pLDDT
    assert [plddts[k] for k in debug["order"]] == sorted(plddts.values(), reverse=True)
    assert set(debug["ptms"]) == set(labels)  # pTM kept as extra information
    ranking = json.loads((folder / "ranking.json").read_text())
    assert ranking["metric"] == "mean_plddt" and ranking["order"] == debug["order"]
    a, b = (Prediction.load(folder / f"pep_model_1_ptm_seed_{s}_prediction.npz") for s in (4, 5))
    assert not np.allclose(a.positions, b.positions)  # other MSA sampling seed, other structure
    best = Prediction.load(folder / f"pep_{debug['order'][0]}_prediction.npz")
    np.testing.assert_allclose(json.loads((folder / "pep_confidence.json").read_text())["plddt"], best.plddt,
                               atol=0.01)


def test_recycles_and_subtracted_plddt_reach_the_outputs(tmp_path):
    target = Target("pep", "MKTAYIAKQR")
    (r0,) = fold_targets([target], _config(tmp_path / "r0", num_recycle=0, subtract_plddt=True))
    (r3,) = fold_targets([target], _config(tmp_path / "r3"))
    a = Prediction.load(tmp_path / "r0" / "pep" / "pep_model_1_ptm_prediction.npz")
    b = Prediction.load(tmp_path / "r3" / "pep" / "pep_model_1_ptm_prediction.npz")
    assert not np.allclose(a.positions, b.positions)
    pdb = from_pdb((tmp_path / "r0" / "pep" / "pep_unrelaxed.pdb").read_text())
    np.testing.assert_allclose(pdb.b_factors[:, 1], 100 - a.plddt, atol=0.01)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_outputs_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        fold_targets([Target("pep", "MKTAYIAK")], _config(tmp_path))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "pep").iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, modes


@pytest.mark.parametrize("kind", ["unconverged", "broken"])
def test_relax_problems_reach_the_table_the_json_and_the_exit_code(tmp_path, monkeypatch, capsys, kind):
    import lowmem.fastfold.relax as relax
    from lowmem.suite.cli import main

    real = relax.relax_protein

    def bad_relax(protein, config=None):
        result = real(protein, config)
        if kind == "unconverged":
            result.violations_after, result.stopped = 4, "pass limit"
        else:
            result.chirality_changed = [2, 3]
        return result

    monkeypatch.setattr(relax, "relax_protein", bad_relax)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMKTAYIAKQR\n")
    argv = ["fold", str(fasta), "--output_dir", str(tmp_path / "out"), "--single_sequence", "--relax_platform", "CPU"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "RELAX FAILED" in out
    folder = tmp_path / "out" / "pep"
    relax_record = json.loads((folder / "timings.json").read_text())["relax"]
    assert relax_record["converged"] is (kind == "broken")
    if kind == "unconverged":
        assert relax_record["problem"].startswith("not converged: 4 violating residue(s)")
        assert "NOT CONVERGED" in (folder / "pep_relaxed.pdb").read_text().splitlines()[0]
    else:
        assert "chirality changed at residue(s) 2, 3" in relax_record["problem"] and relax_record["refused"]
        assert not (folder / "pep_relaxed.pdb").exists() and not (folder / "pep_relaxed.cif").exists()
    assert main(argv) == 1  # the skipped rerun still says so
    assert "RELAX FAILED" in capsys.readouterr().out


def test_file_digest_sees_a_change_anywhere_in_a_large_alignment(tmp_path):
    """A byte changed in the middle of a 5 MiB alignment file changes its digest (only zips are sampled)."""
    import zipfile

    from lowmem.fastfold.data.fingerprint import file_digest

    path = tmp_path / "uniref90_hits.sto"
    data = bytearray(b"A" * (5 << 20))
    path.write_bytes(data)
    before = file_digest(path)
    data[len(data) // 2] = ord("C")
    path.write_bytes(data)
    assert file_digest(path) != before
    big = tmp_path / "params.npz"  # a zip: sampled, and a changed member still shows in its central directory
    with zipfile.ZipFile(big, "w") as z:
        z.writestr("a.npy", bytes(3 << 20))
        z.writestr("b.npy", bytes(10))
    first = file_digest(big)
    with zipfile.ZipFile(big, "w") as z:
        z.writestr("a.npy", bytes(3 << 20)[:-1] + b"\x01")
        z.writestr("b.npy", bytes(10))
    assert file_digest(big) != first
