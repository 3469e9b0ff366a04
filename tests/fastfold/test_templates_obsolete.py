"""Obsolete PDB entries among template hits (OpenFold's and AlphaFold's `--obsolete_pdbs_path`, issue 21): a hit
on an obsolete entry uses its successor's mmCIF file, one on an entry removed without a successor is skipped, and
an unreadable list names itself."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.data.parsers import InputError, parse_hhr
from lowmem.fastfold.data.targets import read_targets
from lowmem.fastfold.data.templates import TemplateConfig, TemplateFeaturizer, read_obsolete_pdbs

ASSETS = Path(__file__).parents[1] / "assets" / "fold"
QUERY = read_targets(ASSETS / "query.fasta")[0].sequence
OBSOLETE = """ LIST OF OBSOLETE COORDINATE ENTRIES AND SUCCESSORS
OBSLTE    31-JUL-94 116L     216L
OBSLTE    01-JAN-20 9ZZZ     4ZEY
OBSLTE    02-FEB-21 3ZEE
OBSLTE    26-SEP-06 2H33     2JM5 2OWI
"""


def test_obsolete_list_maps_to_the_first_successor_or_none(tmp_path):
    path = tmp_path / "obsolete.dat"
    path.write_text(OBSOLETE)
    assert read_obsolete_pdbs(path) == {"116l": "216l", "9zzz": "4zey", "3zee": None, "2h33": "2jm5"}
    path.write_bytes(bytes(range(256)))
    with pytest.raises(InputError, match="obsolete.dat: not a text file"):
        read_obsolete_pdbs(path)
    path.write_text("HEADER nothing here\n")
    with pytest.raises(InputError, match="obsolete.dat: no OBSLTE lines"):
        read_obsolete_pdbs(path)
    path.write_text("OBSLTE    01-JAN-20\n")
    with pytest.raises(InputError, match=r"obsolete.dat: line 1: expected 'OBSLTE date id"):
        read_obsolete_pdbs(path)
    with pytest.raises(InputError, match="missing.dat: cannot be read"):
        read_obsolete_pdbs(tmp_path / "missing.dat")


def test_hits_on_obsolete_entries_use_the_successor_or_are_skipped(tmp_path):
    mmcifs = tmp_path / "mmcifs"
    mmcifs.mkdir()
    for name in ("4zey.cif", "3zee.cif"):
        shutil.copy(ASSETS / "mmcifs" / name, mmcifs)
    hits = {h.name: h for h in parse_hhr((ASSETS / "alignments" / "query" / "pdb70_hits.hhr").read_text())}
    # the 4ZEY_A hit as if it named an entry later replaced by 4ZEY; the 3ZEE_A hit on a removed entry
    chosen = [dataclasses.replace(hits["4ZEY_A"], name="9ZZZ_A"), hits["3ZEE_A"]]
    obsolete = tmp_path / "obsolete.dat"
    obsolete.write_text(OBSOLETE)

    plain = TemplateFeaturizer(TemplateConfig(mmcif_dir=str(mmcifs), max_template_date="2021-01-01"))
    before = plain.get(QUERY, chosen)
    assert before["template_aatype"].shape[0] == 1  # 3ZEE only: there is no 9zzz.cif
    assert [r["reason"] for r in plain.report if not r["used"]] == [f"no 9zzz.cif in {mmcifs}"]

    featurizer = TemplateFeaturizer(TemplateConfig(mmcif_dir=str(mmcifs), max_template_date="2021-01-01",
                                                   obsolete_pdbs_path=str(obsolete)))
    after = featurizer.get(QUERY, chosen)
    used = [r for r in featurizer.report if r["used"]]
    assert [(r["hit"], r["pdb_id"], r["chain"], r.get("replaces")) for r in used] == [("9ZZZ_A", "4zey", "A", "9zzz")]
    assert [r["reason"] for r in featurizer.report if not r["used"]] == [
        "3zee is obsolete, removed from the PDB without a successor"]
    # the successor's coordinates, exactly as the 4ZEY_A hit itself gets them
    direct = TemplateFeaturizer(TemplateConfig(mmcif_dir=str(mmcifs), max_template_date="2021-01-01"))
    reference = direct.get(QUERY, [hits["4ZEY_A"]])
    for key in ("template_aatype", "template_all_atom_positions", "template_all_atom_mask"):
        np.testing.assert_array_equal(after[key], reference[key])
