"""`suite fold --save_outputs` (every model output in an npz, no pickle), the AlphaFold-DB PAE JSON per model, and
`--output_layout openfold` (OpenFold's folder and file names)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lowmem.fastfold.data.targets import AlignmentConfig, Target, target_raw_features
from lowmem.fastfold.run.stages import ModelSpec, Prediction, features_for_model, load_model, predict
from lowmem.suite.cli import main
from tests.fastfold._fold import fold_peptide

SEQUENCE = "MKTAYIAKQR"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One run with --save_outputs and OpenFold's layout: (output folder, FASTA)."""
    return fold_peptide(tmp_path_factory.mktemp("save"), SEQUENCE, "--save_outputs", "--output_layout", "openfold",
                        "--relax_platform", "CPU")


def test_save_outputs_round_trips_every_model_output(saved, tmp_path):
    out, _ = saved
    path = out / "pep" / "pep_model_1_ptm_output_dict.npz"
    with np.load(path, allow_pickle=False) as z:  # plain arrays: no pickle needed to read it
        saved_outputs = {k: z[k] for k in z.files}
    n = len(SEQUENCE)
    assert {"single", "pair", "msa", "distogram_logits", "masked_msa_logits", "final_atom_positions",
            "predicted_aligned_error", "ptm_score", "plddt"} <= set(saved_outputs)
    assert saved_outputs["single"].shape[0] == n and saved_outputs["pair"].shape[:2] == (n, n)
    assert saved_outputs["msa"].shape[1] == n
    # the same model on the same features, in this process, gives the same arrays
    spec = ModelSpec(tiny=True, device="cpu", keep_outputs=True)
    model, feats = load_model(spec)
    raw = target_raw_features(Target("pep", SEQUENCE), AlignmentConfig(single_sequence=True), tmp_path)
    again = predict(model, features_for_model(raw, feats, 0), spec)
    assert set(again.outputs) == set(saved_outputs)
    for key, value in again.outputs.items():
        np.testing.assert_allclose(saved_outputs[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    # the resume cache keeps them too, so a resumed run writes the same file
    cached = Prediction.load(out / "pep" / "pep_model_1_ptm_prediction.npz")
    assert set(cached.outputs) == set(saved_outputs)
    np.testing.assert_array_equal(cached.outputs["pair"], saved_outputs["pair"])


def test_alphafold_db_pae_json_per_model(saved):
    out, _ = saved
    entries = json.loads((out / "pep" / "pep_model_1_ptm_predicted_aligned_error.json").read_text())
    assert isinstance(entries, list) and len(entries) == 1
    entry = entries[0]
    assert set(entry) == {"predicted_aligned_error", "max_predicted_aligned_error"}
    assert entry["max_predicted_aligned_error"] == 31.75
    pae = np.array(entry["predicted_aligned_error"])
    confidence = json.loads((out / "pep" / "pep_confidence.json").read_text())
    assert pae.shape == (len(SEQUENCE), len(SEQUENCE))
    np.testing.assert_allclose(pae, np.array(confidence["pae"]), atol=0.01)


def test_openfold_output_layout(saved):
    out, _ = saved
    predictions = out / "predictions"
    names = sorted(p.name for p in predictions.iterdir())
    assert names == ["pep_model_1_ptm_output_dict.npz", "pep_model_1_ptm_relaxed.pdb", "pep_model_1_ptm_unrelaxed.pdb",
                     "timings.json"]  # PDB only, as OpenFold without --cif_output
    assert (predictions / "pep_model_1_ptm_relaxed.pdb").read_bytes() == (out / "pep" / "pep_relaxed.pdb").read_bytes()
    assert (predictions / "pep_model_1_ptm_unrelaxed.pdb").read_bytes() == \
        (out / "pep" / "pep_model_1_ptm_unrelaxed.pdb").read_bytes()
    # OpenFold's timings files: the run's {tag: {"inference": s}}, the relaxed model's folder {"relaxation": s}
    assert set(json.loads((predictions / "timings.json").read_text())) == {"relaxation"}
    assert set(json.loads((out / "timings.json").read_text())["pep"]) == {"inference"}


def test_adding_save_outputs_to_a_finished_run_redoes_it(saved, caplog):
    out, fasta = saved
    base = ["fold", str(fasta), "--output_dir", str(out), "--single_sequence", "--num_workers", "0", "--no-relax"]
    assert main([*base, "--output_dir", str(out.parent / "plain")]) == 0
    plain = out.parent / "plain"
    assert not (plain / "pep" / "pep_model_1_ptm_output_dict.npz").exists()
    caplog.clear()
    assert main([*base, "--output_dir", str(plain), "--save_outputs"]) == 0
    assert "redone: models/parameters changed" in caplog.text
    assert (plain / "pep" / "pep_model_1_ptm_output_dict.npz").exists()
