"""Where OpenFold users meet `suite fold` (issue 48), with OpenFold's `run_pretrained_openfold.py` as the reference:
its timings files, `.cif` instead of `.pdb` in its layout with `--cif_output`, its `--multimer_ri_gap`, an
alignment of another protein refused before the model, and alignment folders named as OpenFold names targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem.fastfold.data.alignment_files import alignment_folder, openfold_tag
from lowmem.suite.cli import main
from tests.fastfold._fold import fold_peptide

SEQUENCE = "MKTAYIAKQR"


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.fixture(scope="module")
def openfold_cif(tmp_path_factory):
    """One relaxed run in OpenFold's layout with --cif_output: its output folder."""
    out, _ = fold_peptide(tmp_path_factory.mktemp("seam"), SEQUENCE, "--output_layout", "openfold", "--cif_output",
                          "--relax_platform", "CPU")
    return out


def test_openfold_layout_writes_openfolds_timings_files(openfold_cif):
    """OpenFold's `run_model` writes `<output_dir>/timings.json` as {tag: {"inference": s}}; its `relax_protein`
    writes {"relaxation": s} into the prediction folder."""
    top = json.loads((openfold_cif / "timings.json").read_text())
    assert set(top) == {"pep"} and set(top["pep"]) == {"inference"} and top["pep"]["inference"] > 0
    relaxed = json.loads((openfold_cif / "predictions" / "timings.json").read_text())
    assert set(relaxed) == {"relaxation"} and relaxed["relaxation"] > 0


def test_cif_output_writes_cif_instead_of_pdb_in_openfolds_layout(openfold_cif):
    names = sorted(p.name for p in (openfold_cif / "predictions").iterdir())
    assert names == ["pep_model_1_ptm_relaxed.cif", "pep_model_1_ptm_unrelaxed.cif", "timings.json"]
    assert (openfold_cif / "predictions" / "pep_model_1_ptm_relaxed.cif").read_bytes() == \
        (openfold_cif / "pep" / "pep_relaxed.cif").read_bytes()
    assert (openfold_cif / "pep" / "pep_relaxed.pdb").exists()  # the per-target folder keeps both formats


def _gap_fasta(tmp_path: Path) -> Path:
    folder = tmp_path / "fastas"
    folder.mkdir()
    (folder / "ab.fasta").write_text(">a\nMKTAYIAK\n>b\nGSHMLE\n")
    return folder


def _first_residue_numbers(pdb: Path) -> dict[str, int]:
    first: dict[str, int] = {}
    for line in pdb.read_text().splitlines():
        if line.startswith("ATOM"):
            first.setdefault(line[21], int(line[22:26]))
    return first


def test_multimer_ri_gap_is_the_gap_between_records(tmp_path, capsys):
    """OpenFold's default, 200, is accepted; another value is the residue-index jump between the records of a file
    folded as one monomer target (AlphaFold-Gap), in the features and in the written numbering."""
    fastas = _gap_fasta(tmp_path)
    base = ["fold", str(fastas), "--single_sequence", "--no-relax", "--num_workers", "0"]
    assert main([*base, "--output_dir", str(tmp_path / "default"), "--multimer_ri_gap", "200"]) == 0
    capsys.readouterr()
    assert main([*base, "--output_dir", str(tmp_path / "fifty"), "--multimer_ri_gap", "50"]) == 0
    summary = " ".join(capsys.readouterr().out.split())
    assert "residue-index gap 50" in summary and "gap 200" not in summary  # the summary names the gap used
    assert _first_residue_numbers(tmp_path / "default" / "a-b" / "a-b_unrelaxed.pdb") == {"A": 1, "B": 8 + 1 + 200}
    assert _first_residue_numbers(tmp_path / "fifty" / "a-b" / "a-b_unrelaxed.pdb") == {"A": 1, "B": 8 + 1 + 50}
    record = json.loads((tmp_path / "fifty" / "a-b" / "timings.json").read_text())
    assert record["fingerprint"]["residue_index_gap"] == 50


@pytest.mark.parametrize("value", ["0", "x"])
def test_a_bad_multimer_ri_gap_is_one_line(tmp_path, capsys, value):
    assert _exit_code(["fold", str(_gap_fasta(tmp_path)), "--output_dir", str(tmp_path / "o"),
                       "--multimer_ri_gap", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].count("--multimer_ri_gap") == 1


def _alignments(tmp_path: Path, folder: str, query_row: str) -> Path:
    root = tmp_path / "alignments"
    (root / folder).mkdir(parents=True)
    (root / folder / "bfd_uniclust_hits.a3m").write_text(f">query\n{query_row}\n>hit\nMKTAYLAKQR\n")
    return root


def test_an_alignment_of_another_sequence_is_refused_before_the_model(tmp_path, capsys):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">pep\n{SEQUENCE}\n")
    root = _alignments(tmp_path, "pep", "MKTAYIAKQW")  # same length, another sequence
    out = tmp_path / "out"
    assert _exit_code(["fold", str(fasta), "--output_dir", str(out), "--use_precomputed_alignments", str(root),
                       "--no-relax"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(root / "pep" / "bfd_uniclust_hits.a3m") in err[0] and "another sequence" in err[0]
    assert not (out / "pep").exists()  # refused before any work


@pytest.mark.parametrize(("header", "tag"), [("T1050-D1 a domain", "T1050"), ("1abc_A mol:protein", "1abc_A"),
                                            ("pep", "pep"), ("sp|P69905|HBA_HUMAN", "sp")])
def test_openfolds_target_tag(header, tag):
    """OpenFold's `parse_fasta`: the header up to its first non-word character."""
    assert openfold_tag(header) == tag


def test_alignment_folder_named_as_openfold_names_the_target_is_found(tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(f">pep-1 a peptide\n{SEQUENCE}\n")  # our name pep-1, OpenFold's tag pep
    root = _alignments(tmp_path, "pep", SEQUENCE)
    assert alignment_folder(root, "pep-1") == root / "pep"
    out = tmp_path / "out"
    assert main(["fold", str(fasta), "--output_dir", str(out), "--use_precomputed_alignments", str(root),
                 "--no-relax", "--num_workers", "0"]) == 0
    features = json.loads((out / "pep-1" / "features.json").read_text())
    assert features["alignment_dir"] == str(root / "pep") and features["msa_depth_total"] == 3
