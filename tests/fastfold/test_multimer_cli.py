"""`suite fold` with AlphaFold-Multimer presets (issue 22): complexes end to end offline on the tiny random model
(a heterodimer in ColabFold's `A:B` form, a homodimer in OpenFold's one-file-per-complex form), chain IDs in the
PDB and ModelCIF files, the confidence JSON, ranking by 0.8 ipTM + 0.2 pTM, parameter files of the other kind
refused, bad complexes refused, reruns redone when a chain changes; relaxation across chain breaks; the device
budget of `chunk_size="auto"` (issue 18)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lowmem.suite.cli import main

HETERO = ("MKTAYIAKQRQISFVK", "GSHMLEDPVAG")
HOMO = "MKTAYIAKQR"
MULTIMER_PARAMS = Path(__file__).parents[1] / "assets" / "multimer_model" / "params_model_1_multimer_v3.npz"


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def _complexes(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hetero.fasta").write_text(f">hetero\n{HETERO[0]}:{HETERO[1]}\n")
    (folder / "homo.fasta").write_text(f">homo_1\n{HOMO}\n>homo_2\n{HOMO}\n")
    return folder


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Both complexes folded and relaxed with `--model_preset multimer` (tiny random model_1_multimer_v3)."""
    tmp = tmp_path_factory.mktemp("multimer")
    fastas = _complexes(tmp / "fastas")
    out = tmp / "out"
    code = main(["fold", str(fastas), "--model_preset", "multimer", "--output_dir", str(out), "--num_workers", "0",
                 "--relax_platform", "CPU"])
    assert code == 0
    return out


def test_one_chain_id_per_chain_in_pdb_and_mmcif(finished):
    gemmi = pytest.importorskip("gemmi")
    from Bio.PDB.MMCIFParser import MMCIFParser

    for name, chains in (("hetero", {"A": HETERO[0], "B": HETERO[1]}), ("homo", {"A": HOMO, "B": HOMO})):
        for kind in ("unrelaxed", "relaxed"):
            structure = gemmi.read_structure(str(finished / name / f"{name}_{kind}.pdb"))
            got = {ch.name: gemmi.one_letter_code([r.name for r in ch]) for ch in structure[0]}
            assert got == chains, (name, kind)
            numbers = {ch.name: [r.seqid.num for r in ch] for ch in structure[0]}
            assert all(n == list(range(1, len(chains[c]) + 1)) for c, n in numbers.items())  # from 1 per chain
            cif = MMCIFParser(QUIET=True).get_structure(name, str(finished / name / f"{name}_{kind}.cif"))
            assert sorted(c.id for c in cif[0]) == sorted(chains)
            assert {c.id: len(c) for c in cif[0]} == {c: len(s) for c, s in chains.items()}


def test_mmcif_is_modelcif_with_one_asym_per_chain_and_ptm_iptm(finished):
    pytest.importorskip("modelcif")
    import io

    import modelcif.reader

    for name, entities in (("hetero", 2), ("homo", 1)):
        text = (finished / name / f"{name}_unrelaxed.cif").read_text()
        (system,) = modelcif.reader.read(io.StringIO(text))
        assert len(system.entities) == entities
        assert sorted(a.id for a in system.asym_units) == ["A", "B"]
        (model,) = list(system.model_groups[0])
        glob = {type(q).__name__: q.value for q in model.qa_metrics if not hasattr(q, "residue")}
        conf = json.loads((finished / name / f"{name}_confidence.json").read_text())
        assert glob["pTM"] == pytest.approx(conf["ptm"], abs=1e-4)
        assert glob["ipTM"] == pytest.approx(conf["iptm"], abs=1e-4)
        local = [q for q in model.qa_metrics if hasattr(q, "residue")]
        assert [(q.residue.asym.id, q.residue.seq_id) for q in local][:2] == [("A", 1), ("A", 2)]
        assert {q.residue.asym.id for q in local} == {"A", "B"}


def test_confidence_json_per_chain_and_interface(finished):
    for name, lengths in (("hetero", [len(s) for s in HETERO]), ("homo", [len(HOMO)] * 2)):
        conf = json.loads((finished / name / f"{name}_confidence.json").read_text())
        assert 0.0 <= conf["iptm"] <= 1.0 and 0.0 <= conf["ptm"] <= 1.0
        assert conf["ranking_confidence"] == pytest.approx(0.8 * conf["iptm"] + 0.2 * conf["ptm"], abs=2e-4)
        chains = conf["chains"]
        assert [c["chain_id"] for c in chains] == ["A", "B"]
        assert [c["residues"][1] - c["residues"][0] for c in chains] == lengths
        plddt, pae = np.array(conf["plddt"]), np.array(conf["pae"])
        assert pae.shape == (sum(lengths),) * 2
        pair = np.array(conf["chain_pair_pae"])
        assert pair.shape == (2, 2) and np.array(conf["chain_pair_pae_min"]).shape == (2, 2)
        for i, a in enumerate(chains):
            assert a["mean_plddt"] == pytest.approx(plddt[slice(*a["residues"])].mean(), abs=0.02)
            for j, b in enumerate(chains):
                block = pae[slice(*a["residues"]), slice(*b["residues"])]
                assert pair[i, j] == pytest.approx(block.mean(), abs=0.02)
        record = json.loads((finished / name / "timings.json").read_text())
        assert [c["chain_id"] for c in record["chains"]] == ["A", "B"]
        assert record["relax"]["violations_after"] == 0  # the chain break is not a broken peptide bond
        debug = json.loads((finished / name / "ranking_debug.json").read_text())
        assert debug["order"] == ["model_1_multimer_v3"] and set(debug) >= {"iptm+ptm", "iptms", "ptms", "plddts"}
        assert (finished / name / f"{name}_pae.png").stat().st_size > 0


def test_ranking_is_08_iptm_plus_02_ptm(tmp_path):
    """A model with the higher pTM but the lower ranking confidence ranks second; the best is written under the
    target's name (its REMARK names it)."""
    from lowmem.fastfold.run import Prediction, read_complex_targets, write_target_outputs

    fasta = tmp_path / "c.fasta"
    fasta.write_text(f">c\n{HETERO[0]}:{HETERO[1]}\n")
    (target,) = read_complex_targets(fasta)
    n = len(target.sequence)
    rng = np.random.default_rng(0)

    def pred(ptm: float, iptm: float) -> Prediction:
        return Prediction(rng.normal(size=(n, 37, 3)).astype(np.float32), np.ones((n, 37), np.float32),
                          np.full(n, 50.0, np.float32), np.full((n, n), 5.0, np.float32), ptm, iptm,
                          0.8 * iptm + 0.2 * ptm)

    preds = {"model_1_multimer_v3": pred(0.9, 0.1), "model_2_multimer_v3": pred(0.2, 0.5),
             "model_3_multimer_v3": pred(0.5, 0.3)}
    write_target_outputs(target, preds, tmp_path / "out")
    debug = json.loads((tmp_path / "out" / "ranking_debug.json").read_text())
    assert debug["order"] == ["model_2_multimer_v3", "model_3_multimer_v3", "model_1_multimer_v3"]
    assert debug["iptm+ptm"]["model_2_multimer_v3"] == pytest.approx(0.44)
    assert "model model_2_multimer_v3" in (tmp_path / "out" / "c_unrelaxed.pdb").read_text().splitlines()[0]


def test_param_files_of_the_other_kind_are_refused(tmp_path, capsys):
    import torch

    from lowmem.fastfold.model import AlphaFold, config
    from lowmem.fastfold.params import save_params

    torch.manual_seed(0)
    mono = tmp_path / "params_model_1_ptm.npz"
    save_params(AlphaFold(config.tiny()), mono)
    fastas = _complexes(tmp_path / "fastas")
    base = ["fold", str(fastas / "hetero.fasta"), "--output_dir", str(tmp_path / "o"), "--no-relax"]
    assert _exit_code([*base, "--model_name", "model_1_multimer_v3", "--param_path", str(mono)]) == 2
    err = capsys.readouterr().err
    assert "looks like a monomer AlphaFold file" in err and "needs AlphaFold-Multimer weights" in err
    assert _exit_code([*base, "--model_name", "model_1_ptm"]) == 2  # a complex needs a multimer model
    assert "make a complex: fold it with --model_preset multimer" in capsys.readouterr().err
    mono_fasta = tmp_path / "mono.fasta"
    mono_fasta.write_text(f">m\n{HOMO}\n")
    assert _exit_code(["fold", str(mono_fasta), "--output_dir", str(tmp_path / "o"), "--model_name", "model_1_ptm",
                       "--param_path", str(MULTIMER_PARAMS)]) == 2
    assert "looks like an AlphaFold-Multimer file, but --model_name model_1_ptm is a monomer" in capsys.readouterr().err
    assert _exit_code([*base, "--model_name", "model_1_multimer_v2", "--param_path", str(MULTIMER_PARAMS)]) == 2
    assert "looks like a v3 AlphaFold-Multimer file" in capsys.readouterr().err
    assert _exit_code([*base, "--model_name", "model_1_multimer_v3,model_1_ptm"]) == 2
    assert "mixes monomer and AlphaFold-Multimer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_multimer_param_file_runs(tmp_path, capsys):
    fastas = _complexes(tmp_path / "fastas")
    argv = ["fold", str(fastas / "hetero.fasta"), "--output_dir", str(tmp_path / "o"), "--no-relax",
            "--model_name", "model_1_multimer_v3", "--param_path", str(MULTIMER_PARAMS), "--num_recycle", "1"]
    assert main(argv) == 0
    assert "RANDOM WEIGHTS" not in capsys.readouterr().err
    conf = json.loads((tmp_path / "o" / "hetero" / "hetero_confidence.json").read_text())
    assert 0.0 <= conf["iptm"] <= 1.0 and len(conf["plddt"]) == sum(map(len, HETERO))


@pytest.mark.parametrize(("text", "message"), [
    (">c\nMKT::GSH\n", "empty"),
    (">c\nMKT:GSH/AAA\n", "separator"),
    (">c\n:MKT\n", "empty"),
])
def test_bad_complex_input_is_one_line_exit_2(tmp_path, capsys, text, message):
    fasta = tmp_path / "bad.fasta"
    fasta.write_text(text)
    assert _exit_code(["fold", str(fasta), "--model_preset", "multimer", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(str(fasta) in line and message in line for line in err), err
    assert not (tmp_path / "o").exists()


def test_rerun_with_a_changed_chain_is_redone(tmp_path, capsys):
    fasta = tmp_path / "c.fasta"
    fasta.write_text(f">c\n{HETERO[0]}:{HETERO[1]}\n")
    argv = ["fold", str(fasta), "--model_preset", "multimer", "--output_dir", str(tmp_path / "o"), "--no-relax"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert "skipped" in capsys.readouterr().out
    first = json.loads((tmp_path / "o" / "c" / "c_confidence.json").read_text())
    fasta.write_text(f">c\n{HETERO[0]}:{HETERO[1][:-1]}W\n")  # chain B's last residue changed
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "redone" in out and "sequence" in out and "skipped" not in out
    pdb = (tmp_path / "o" / "c" / "c_unrelaxed.pdb").read_text()
    assert " TRP B  11" in pdb
    second = json.loads((tmp_path / "o" / "c" / "c_confidence.json").read_text())
    assert second["plddt"] != first["plddt"]


def test_chain_break_is_not_a_broken_peptide_bond():
    """Two chains numbered from 1, far apart: no violation at the break; the same atoms as one chain numbered
    on through the break have one (the test can fail)."""
    from lowmem.fastfold.io.protein import Protein, from_pdb, to_pdb
    from lowmem.fastfold.relax.amber import _violations, cis_peptides

    n = 4
    pos = np.zeros((2 * n, 37, 3))
    mask = np.zeros((2 * n, 37))
    for i in range(2 * n):  # N, CA, C on a line, 3.8 A per residue; chain B 40 A away
        x = 3.8 * (i % n) + (40.0 if i >= n else 0.0)
        pos[i, :3] = [[x, 0, 0], [x + 1.46, 0, 0], [x + 2.5, 0.5, 0]]
        mask[i, :3] = 1.0
    aatype = np.zeros(2 * n, np.int64)
    numbers = np.concatenate([np.arange(1, n + 1), np.arange(1, n + 1)])
    b = np.full((2 * n, 37), 50.0)
    two = Protein(pos, mask, aatype, numbers, b, chain_index=np.repeat([0, 1], n), chain_ids=("A", "B"))
    one = Protein(pos, mask, aatype, np.arange(1, 2 * n + 1), b)
    assert not _violations(two)[n - 1:n + 1].any()
    assert _violations(one)[n - 1:n + 1].all()
    assert cis_peptides(two)[n - 1] == 0
    back = from_pdb(to_pdb(two))
    assert back.chain_ids == ("A", "B") and list(back.chain_index) == [0] * n + [1] * n
    assert to_pdb(two).count("TER") == 2
    with pytest.raises(ValueError, match="chain_ids"):
        Protein(pos, mask, aatype, numbers, b, chain_index=np.repeat([0, 1], n), chain_ids=("A",))


def test_auto_chunk_size_uses_the_models_device_budget(monkeypatch):
    """Issue 18: `suite fold --chunk_size auto` gets `InferenceOptions.for_device` of where the model runs."""
    import torch

    from lowmem.fastfold.model import options as opts
    from lowmem.fastfold.run import stages

    spec = stages.ModelSpec(chunk_size="auto", device="cpu")
    assert stages._inference_options(spec, torch.device("cpu")).memory_budget_bytes == opts.CPU_BUDGET_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 141 * 2**30))
    auto = stages._inference_options(spec, torch.device("cuda", 0))
    assert auto.chunk_size == "auto" and auto.memory_budget_bytes == 20 * 2**30
    fixed = stages._inference_options(stages.ModelSpec(chunk_size=4), torch.device("cuda", 0))
    assert fixed.chunk_size == 4


def test_recipe_folds_a_complex_as_suite_fold_does(tmp_path):
    """recipes.fold: `FoldDataModule(multimer=True)` with a multimer predictor writes the complex's files; same
    coordinates as `suite fold` with the same seed."""
    import lightning.pytorch as pl

    from lowmem.recipes import AlphaFoldPredictor, FoldDataModule, FoldPredictionWriter
    from lowmem.recipes.fold import load_recipe

    fasta = tmp_path / "c.fasta"
    fasta.write_text(f">c\n{HETERO[0]}:{HETERO[1]}\n")
    assert main(["fold", str(fasta), "--model_preset", "multimer", "--output_dir", str(tmp_path / "cli"),
                 "--no-relax"]) == 0
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[FoldPredictionWriter(tmp_path / "r", relax=False)],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.predict(AlphaFoldPredictor(model_name="model_1_multimer_v3", seed=0),
                    datamodule=FoldDataModule(fasta, single_sequence=True, multimer=True))
    a = json.loads((tmp_path / "cli" / "c" / "c_confidence.json").read_text())
    b = json.loads((tmp_path / "r" / "c" / "c_confidence.json").read_text())
    assert [c["chain_id"] for c in b["chains"]] == ["A", "B"] and b["iptm"] == pytest.approx(a["iptm"], abs=1e-3)
    np.testing.assert_allclose(b["plddt"], a["plddt"], atol=0.05)
    assert " B   1" in (tmp_path / "r" / "c" / "c_unrelaxed.pdb").read_text()
    with pytest.raises(ValueError, match="multimer"):
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False).predict(
            AlphaFoldPredictor(model_name="model_1_ptm"), datamodule=FoldDataModule(fasta, multimer=True))
    recipe = tmp_path / "fold.yaml"
    recipe.write_text("model_preset: multimer\nfasta_path: c.fasta\n")
    loaded = load_recipe(recipe)
    assert loaded["data"]["multimer"] and loaded["predictor"]["model_name"] == "model_1_multimer_v3"
