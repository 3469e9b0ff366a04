"""Issue 21 bullets the other fold tests leave unchecked: the summary says what went into each target's features
(also for a skipped rerun), every plot and structure file of an untrained model carries the random-weights mark
(and none of a run with parameters does), and the fingerprint parts no other test changes (MSA mode, model name,
precision, template settings, relaxation settings) each redo a finished target and are named in its note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem.fastfold.run import (
    AlignmentConfig,
    ModelSpec,
    Target,
    fold_targets,
    read_targets,
    target_fingerprint,
)
from tests.fastfold.test_pipeline import _config

ASSETS = Path(__file__).parents[1] / "assets" / "fold"
QUERY = read_targets(ASSETS / "query.fasta")[0]
PEP = Target("pep", "MKTAYIAKQR")


def _short(name: str) -> str:
    """The summary's short name of an alignment file (uniref90_hits.sto -> uniref90)."""
    return name.split("_hits")[0].split(".")[0]


def test_the_summary_says_what_went_in(tmp_path, capsys, monkeypatch):
    alignment = AlignmentConfig(precomputed_dir=str(ASSETS / "alignments"), template_mmcif_dir=str(ASSETS / "mmcifs"),
                                max_template_date="2021-01-01")
    cfg = _config(tmp_path / "out", models=[ModelSpec(model_name="model_1", tiny=True)], alignment=alignment)
    (done,) = fold_targets([QUERY], cfg)
    assert done.status == "done", done.error
    info = json.loads((tmp_path / "out" / "query" / "features.json").read_text())
    files = info["alignment_files"]
    assert [f["file"] for f in files] == ["uniref90_hits.sto", "mgnify_hits.sto", "bfd_uniclust_hits.a3m"]
    msa, templates = done.inputs.split("; ")
    per_file = ", ".join(f"{_short(f['file'])} {f['rows_used']}" for f in files)
    assert msa == f"MSA {info['msa_depth_dedup']} of {info['msa_depth_total']} ({per_file})"
    assert info["msa_depth_dedup"] < info["msa_depth_total"]  # duplicates removed, and the summary shows both
    assert templates.startswith("templates ")
    assert set(templates.split()[1:]) == {"4zey_A", "3zee_A", "4i6p_A"}
    (again,) = fold_targets([QUERY], cfg)
    assert again.status == "skipped" and again.inputs == done.inputs  # a skipped rerun says the same

    # the command's table prints the same words
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMKTAYIAK\n")
    argv = ["fold", str(fasta), "--output_dir", str(tmp_path / "cli"), "--single_sequence", "--no-relax",
            "--num_workers", "0"]
    from lowmem.suite.cli import main

    assert main(argv) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if " pep " in line]
    assert row and "single sequence; no templates" in row[0], row


def _red_pixels(path: Path) -> int:
    import matplotlib.image as mpimg

    img = mpimg.imread(path)[..., :3]
    return int(((img[..., 0] > 0.8) & (img[..., 1] < 0.6) & (img[..., 2] < 0.6)).sum())


@pytest.fixture
def params(tmp_path):
    import torch

    from lowmem.fastfold.model import AlphaFold, config
    from lowmem.fastfold.params import save_params

    torch.manual_seed(3)
    path = tmp_path / "params_model_1_ptm.npz"
    save_params(AlphaFold(config.tiny()), path)
    return path


def test_every_plot_and_structure_of_random_weights_is_marked(tmp_path, params):
    """Made without --param_path: every pLDDT and PAE plot (the best model's and each seed's) has the red stamp,
    every PDB and mmCIF the remark; with a parameter file none has either."""
    (random,) = fold_targets([PEP], _config(tmp_path / "random", num_seeds=2))
    spec = ModelSpec(model_name="model_1_ptm", param_path=str(params))
    (trained,) = fold_targets([PEP], _config(tmp_path / "trained", models=[spec], num_seeds=2))
    assert random.status == trained.status == "done"
    for run, marked in (("random", True), ("trained", False)):
        folder = tmp_path / run / "pep"
        plots = sorted(folder.glob("*_pae.png")) + sorted(folder.glob("*_plddt.png"))
        assert len(plots) == 6, plots  # the best model's and each of the two seeds'
        for png in plots:
            assert (_red_pixels(png) > 500) is marked, (png.name, _red_pixels(png))
        structures = sorted(folder.glob("*_unrelaxed.pdb")) + sorted(folder.glob("*_unrelaxed.cif"))
        assert len(structures) == 6
        for path in structures:
            assert ("RANDOM WEIGHTS" in path.read_text()) is marked, path.name


def test_each_fingerprint_part_redoes_the_target_and_is_named(tmp_path):
    """MSA mode, model name, precision: a finished target is redone and the note names what changed."""
    out = tmp_path / "out"
    aln = tmp_path / "alignments" / "pep"
    aln.mkdir(parents=True)
    (aln / "bfd_uniref_hits.a3m").write_text(">pep\nMKTAYIAKQR\n>h\nMKTAhYIARQR\n")
    precomputed = AlignmentConfig(precomputed_dir=str(tmp_path / "alignments"))
    assert fold_targets([PEP], _config(out))[0].status == "done"  # single sequence
    steps = [  # each changes one part of the one before
        ({"alignment": precomputed}, "alignments"),
        ({"alignment": AlignmentConfig(precomputed_dir=str(tmp_path / "alignments"), single_sequence=True)},
         "alignments"),  # same folder, folded from the query alone: another MSA mode
        ({"models": [ModelSpec(model_name="model_2_ptm", tiny=True)]}, "models/parameters"),
        ({"models": [ModelSpec(model_name="model_2_ptm", tiny=True, precision="fp64")]}, "precision"),
    ]
    kw: dict = {}
    for change, label in steps:
        kw = {**kw, **change}
        (r,) = fold_targets([PEP], _config(out, **kw))
        assert r.status == "done" and r.note == f"redone: {label} changed", (kw, r.note)
        (same,) = fold_targets([PEP], _config(out, **kw))
        assert same.status == "skipped", (kw, same.note)


def test_template_and_relax_settings_are_in_the_fingerprint():
    from lowmem.fastfold.data.fingerprint import diff
    from lowmem.fastfold.relax import RelaxConfig

    base = AlignmentConfig(template_mmcif_dir=str(ASSETS / "mmcifs"), max_template_date="2021-01-01")
    first = target_fingerprint(PEP, _config(Path("o"), alignment=base))
    for other in (AlignmentConfig(template_mmcif_dir=str(ASSETS / "mmcifs"), max_template_date="2020-01-01"),
                  AlignmentConfig(template_mmcif_dir=str(ASSETS), max_template_date="2021-01-01"),
                  AlignmentConfig(max_template_date="2021-01-01")):
        assert diff(first, target_fingerprint(PEP, _config(Path("o"), alignment=other))) == ["templates"]
    relaxed = target_fingerprint(PEP, _config(Path("o"), alignment=base, relax=RelaxConfig()))
    assert diff(first, relaxed) == ["relax"]
    for change in ({"max_outer_iterations": 3}, {"max_seconds": 60.0}, {"max_iterations": 500},
                   {"stiffness": 5.0}):
        assert diff(relaxed, target_fingerprint(PEP, _config(Path("o"), alignment=base,
                                                             relax=RelaxConfig(**change)))) == ["relax"], change
