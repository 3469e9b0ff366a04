"""What goes into a target's features, as a biologist's real files give it (issue 21): FASTA as databases
write it (UniProt headers, a byte-order mark, a folder of files), alignment folders (gzipped, capped as
AlphaFold caps them, binary files named, empty ones refused), modified template residues mapped to their
parent amino acid, and the record of what the features were made of."""

from __future__ import annotations

import gzip
import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.data.mmcif import parent_residue, parse_mmcif
from lowmem.fastfold.data.parsers import InputError, parse_a3m, parse_fasta
from lowmem.fastfold.data.targets import (
    MAX_HITS,
    AlignmentConfig,
    Target,
    read_alignment_dir,
    read_targets,
    target_raw_features,
)

ASSETS = Path(__file__).parents[1] / "assets" / "fold"
ALIGN = ASSETS / "alignments" / "query"
QUERY = read_targets(ASSETS / "query.fasta")[0]


# ----------------------------------------------------------------------------------------------- FASTA


def test_uniprot_header_names_the_target_from_its_accession_and_keeps_the_header(tmp_path):
    path = tmp_path / "ubc.fasta"
    path.write_bytes("\ufeff>sp|P0CG48|UBC_HUMAN Polyubiquitin-C OS=Homo sapiens\nMQIFVK\n>tr|A0A024R|X y\nGG\n"
                     .encode("utf-8"))
    targets = read_targets(path)
    assert [t.name for t in targets] == ["P0CG48", "A0A024R"]
    assert targets[0].description == "sp|P0CG48|UBC_HUMAN Polyubiquitin-C OS=Homo sapiens"
    assert targets[0].sequence == "MQIFVK"
    assert parse_fasta(">plain name here\nMK\n") == [("plain", "MK")]


def test_a_folder_of_fasta_files_is_read_in_name_order_and_names_stay_unique(tmp_path):
    (tmp_path / "b.fa").write_text(">second\nGG\n")
    (tmp_path / "a.fasta").write_text(">first\nMK\n")
    (tmp_path / "notes.txt").write_text("not read\n")
    assert [t.name for t in read_targets(tmp_path)] == ["first", "second"]
    (tmp_path / "c.faa").write_text(">first\nAA\n")
    with pytest.raises(InputError, match=r"c.faa: target 'first' is also in .*a.fasta"):
        read_targets(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="folder holds no FASTA file"):
        read_targets(empty)


# ---------------------------------------------------------------------------------------------- alignments


def _stockholm(n: int, length: int = 5) -> str:
    """A Stockholm alignment of `n` distinct rows (the query first)."""
    rows = ["".join(p) for p in itertools.islice(itertools.product("ACDEFGHIKLMNPQRSTVWY", repeat=length), n)]
    body = "\n".join(f"s{k} {row}" for k, row in enumerate(rows))
    return f"# STOCKHOLM 1.0\n{body}\n//\n", rows[0]


def test_alphafold_hit_caps_per_search_result(tmp_path):
    text, query = _stockholm(MAX_HITS["mgnify_hits.sto"] + 99)
    (tmp_path / "mgnify_hits.sto").write_text(text)
    (tmp_path / "other_hits.sto").write_text(text)  # no cap for a name AlphaFold does not cap
    info: dict = {}
    msas, _ = read_alignment_dir(tmp_path, query, info)
    assert [len(m) for m in msas] == [501, 600]
    rows = {f["file"]: (f["rows"], f["rows_used"]) for f in info["alignment_files"]}
    assert rows == {"mgnify_hits.sto": (600, 501), "other_hits.sto": (600, 600)}
    assert MAX_HITS["uniref90_hits.sto"] == 10_000


def test_gzipped_alignments_are_read_and_unknown_files_are_reported(tmp_path, caplog):
    folder = tmp_path / "query"
    folder.mkdir()
    with gzip.open(folder / "bfd_uniclust_hits.a3m.gz", "wt") as f:
        f.write((ALIGN / "bfd_uniclust_hits.a3m").read_text())
    (folder / "readme.txt").write_text("notes\n")
    info: dict = {}
    msas, hits = read_alignment_dir(folder, QUERY.sequence, info)
    plain = parse_a3m((ALIGN / "bfd_uniclust_hits.a3m").read_text())
    assert len(msas) == 1 and msas[0].sequences == plain.sequences and len(plain) > 100
    assert msas[0].deletion_matrix == plain.deletion_matrix
    assert info["ignored_files"] == ["readme.txt"] and "ignoring readme.txt" in caplog.text


def test_a_folder_without_alignment_files_is_refused_or_said(tmp_path, caplog):
    folder = tmp_path / "query"
    folder.mkdir()
    (folder / "hits.txt").write_text("x\n")
    with pytest.raises(InputError, match=r"no alignment file .* it holds only hits.txt; add --single_sequence"):
        read_alignment_dir(folder, QUERY.sequence, require_msa=True)
    msas, _ = read_alignment_dir(folder, QUERY.sequence)
    assert msas == [] and "NO ALIGNMENT FILE" in caplog.text


@pytest.mark.parametrize("name", ["uniref90_hits.sto", "pdb70_hits.hhr", "bfd_uniclust_hits.a3m.gz"])
def test_a_binary_alignment_file_names_itself(tmp_path, name):
    folder = tmp_path / "query"
    folder.mkdir()
    data = bytes(range(256)) * 4
    if name.endswith(".gz"):
        data = gzip.compress(data)
    (folder / name).write_bytes(data)
    shutil.copy(ALIGN / "mgnify_hits.sto", folder)
    with pytest.raises(InputError, match=rf"{name}: not a text file"):
        read_alignment_dir(folder, QUERY.sequence)


def test_features_record_what_went_in(tmp_path):
    cfg = AlignmentConfig(precomputed_dir=str(ASSETS / "alignments"), template_mmcif_dir=str(ASSETS / "mmcifs"),
                          max_template_date="2021-01-01")
    info: dict = {}
    raw = target_raw_features(QUERY, cfg, tmp_path, info=info)
    assert info["msa_mode"] == "precomputed"
    files = [f["file"] for f in info["alignment_files"]]
    assert files == ["uniref90_hits.sto", "mgnify_hits.sto", "bfd_uniclust_hits.a3m"]  # AlphaFold's MSA order
    assert info["msa_depth_total"] == 1 + sum(f["rows_used"] for f in info["alignment_files"])
    assert info["msa_depth_dedup"] == raw["msa"].shape[0] < info["msa_depth_total"]
    used = {(t["pdb_id"], t["chain"]) for t in info["templates"]}
    assert used == {("4zey", "A"), ("3zee", "A"), ("4i6p", "A")}
    assert all(t["release_date"] <= "2021-01-01" and t["aligned_cols"] > 0 for t in info["templates"])
    assert raw["template_aatype"].shape[0] == 3
    assert any("no 1hf9.cif" in t["reason"] for t in info["templates_skipped"])

    alone: dict = {}
    single = AlignmentConfig(precomputed_dir=str(ASSETS / "alignments"), single_sequence=True,
                             template_mmcif_dir=str(ASSETS / "mmcifs"), max_template_date="2021-01-01")
    raw = target_raw_features(QUERY, single, tmp_path, info=alone)
    assert raw["msa"].shape[0] == 1 and alone["msa_depth_dedup"] == 1
    assert len(alone["templates"]) == 3  # --single_sequence with a folder: its template hits are still used


# ------------------------------------------------------------------------------------------- templates


@pytest.mark.parametrize(("name", "parent"), [("MSE", "MET"), ("SEP", "SER"), ("TPO", "THR"), ("MLY", "LYS"),
                                              ("PTR", "TYR"), ("HYP", "PRO"), ("ALA", "ALA"), ("HOH", None),
                                              ("DA", None), ("ZZZQ", None)])
def test_modified_residues_map_to_their_parent(name, parent):
    assert parent_residue(name) == parent


def test_modified_template_residues_keep_the_parent_atoms():
    rows = [("GLY", [("CA", 0.0)]), ("SEP", [("N", 1.0), ("CA", 2.0), ("CB", 3.0), ("OG", 4.0), ("P", 5.0)]),
            ("MSE", [("CA", 6.0), ("SE", 7.0)]), ("HOH", [])]
    atoms = []
    serial = itertools.count(1)
    for seq_id, (mon, names) in enumerate(rows, start=1):
        atoms += [f"{next(serial)} A {seq_id} {atom} {mon} {x} 0.0 0.0" for atom, x in names]
    text = ("data_x\nloop_\n_pdbx_poly_seq_scheme.pdb_strand_id\n_pdbx_poly_seq_scheme.seq_id\n"
            "_pdbx_poly_seq_scheme.mon_id\n" + "".join(f"A {k} {m}\n" for k, (m, _) in enumerate(rows, start=1))
            + "#\nloop_\n_atom_site.id\n_atom_site.auth_asym_id\n_atom_site.label_seq_id\n_atom_site.label_atom_id\n"
            "_atom_site.label_comp_id\n_atom_site.Cartn_x\n_atom_site.Cartn_y\n_atom_site.Cartn_z\n"
            + "\n".join(atoms) + "\n#\n")
    chain = parse_mmcif(text, "mod.cif").chains["A"]
    assert chain.sequence == "GSMX"
    present = {rc.atom_types[j] for j in np.nonzero(chain.mask[1])[0]}
    assert present == {"N", "CA", "CB", "OG"}  # the phosphate is not a serine atom
    assert chain.positions[1, rc.atom_order["OG"], 0] == 4.0
    assert chain.positions[2, rc.atom_order["SD"], 0] == 7.0  # selenium in methionine's sulfur place


def test_an_unreadable_mmcif_names_itself():
    with pytest.raises(InputError, match="bad.cif: not an mmCIF coordinate file"):
        parse_mmcif("data_x\n_cell.length_a 1.0\n", "bad.cif")
    with pytest.raises(InputError, match="bad.cif: not a readable mmCIF file"):
        parse_mmcif("data_x\nloop_\n_a.b\n_a.c\n1\n'unterminated\n", "bad.cif")


def test_target_keeps_its_header_out_of_equality():
    assert Target("a", "MK", "sp|a|x") == Target("a", "MK")
