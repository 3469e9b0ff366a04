"""Parsers on real-format files and nasty ones the tests write, MSA/template features, the processed batch,
and jackhmmer against a small database the test builds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.data.features import (
    FeatureConfig,
    empty_template_features,
    make_msa_features,
    make_sequence_features,
    process_features,
)
from lowmem.fastfold.data.mmcif import parse_mmcif
from lowmem.fastfold.data.parsers import InputError, parse_a3m, parse_fasta, parse_hhr, parse_stockholm
from lowmem.fastfold.data.templates import TemplateConfig, TemplateFeaturizer

ASSETS = Path(__file__).parents[1] / "assets" / "fold"
ALIGN = ASSETS / "alignments" / "query"
QUERY = (ASSETS / "query.fasta").read_text().split("\n")[1]


# ----------------------------------------------------------------------------------------------- FASTA


def test_fasta_many_records_lower_case_and_wrapped_lines():
    text = ">a first target\nmkt\nAYI\n\n>b\nGSW*\n"
    assert parse_fasta(text) == [("a", "MKTAYI"), ("b", "GSW")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (">a\n\n>b\nMK\n", "record 1 (a, line 1): empty sequence"),
        (">a\nMK1T\n", "record 1 (a, line 1): position 3: '1' is not an amino-acid letter"),
        (">a\nMK\n>a\nGG\n", "record 2 (a, line 3): duplicate name 'a' (first at record 1)"),
        ("MKTAYI\n", "line 1: not FASTA"),
        ("", "no FASTA records"),
        (">\nMK\n", "empty header"),
        (">a/b\nMK\n", "may only hold letters"),
    ],
)
def test_fasta_errors_name_record_and_position(text, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_fasta(text, "in.fasta")


def test_fasta_ambiguous_residues_warn_and_become_unknown(caplog):
    ((name, seq),) = parse_fasta(">x\nMXBZUO\n")
    assert seq == "MXBZUO"
    assert "modelled as unknown" in caplog.text
    aatype = make_sequence_features(seq)["aatype"]
    assert aatype.tolist() == [rc.restype_order["M"]] + [rc.unk_restype_index] * 5


# ----------------------------------------------------------------------------------------------- MSAs


def test_a3m_insertions_become_deletion_counts():
    msa = parse_a3m(">q\nMKTAY\n>s1\nM-kkTaAY\n>s2 lower case only at the end\nMKTAYggg\n")
    assert msa.sequences == ["MKTAY", "M-TAY", "MKTAY"]
    assert msa.deletion_matrix[1] == [0, 0, 2, 1, 0]
    assert msa.deletion_matrix[2] == [0] * 5  # trailing insertions precede no column


def test_a3m_rejects_ragged_rows():
    with pytest.raises(InputError, match="record 2 .*4 aligned columns, the query has 5"):
        parse_a3m(">q\nMKTAY\n>s\nMKTa-\n", "x.a3m")


def test_stockholm_query_gaps_are_insertions():
    text = "# STOCKHOLM 1.0\n#=GF ID x\nq   MK--TAY\ns1  MKGGT-Y\ns2  mk.ata.\n\nq   GG\ns1  G-\ns2  -G\n//\n"
    msa = parse_stockholm(text)
    assert msa.sequences[0] == "MKTAYGG"
    assert msa.sequences[1] == "MKT-YG-"
    assert msa.deletion_matrix[1] == [0, 0, 2, 0, 0, 0, 0]
    assert msa.deletion_matrix[2] == [0, 0, 1, 0, 0, 0, 0]
    assert msa.sequences[2] == "MKTA--G"  # lower case is upper-cased, "." is a gap


def test_stockholm_rejects_other_formats():
    with pytest.raises(InputError, match="line 1: not a Stockholm file"):
        parse_stockholm(">q\nMK\n", "x.sto")


def test_real_alignment_files_parse():
    uniref = parse_stockholm((ALIGN / "uniref90_hits.sto").read_text())
    bfd = parse_a3m((ALIGN / "bfd_uniclust_hits.a3m").read_text())
    assert uniref.sequences[0] == QUERY and bfd.sequences[0] == QUERY
    assert all(len(s) == len(QUERY) for s in uniref.sequences + bfd.sequences)
    assert len(bfd) == 1024 and any(any(d) for d in bfd.deletion_matrix)
    feats = make_msa_features(QUERY, [uniref, bfd])
    assert feats["msa"].shape[1] == len(QUERY)
    assert len(np.unique(feats["msa"], axis=0)) == len(feats["msa"])  # duplicates removed
    assert feats["msa"][0].tolist() == make_sequence_features(QUERY)["aatype"].tolist()


def test_hhr_hits():
    hits = parse_hhr((ALIGN / "pdb70_hits.hhr").read_text())
    assert [h.name for h in hits[:3]] == ["1HF9_B", "2CRB_A", "4ZEY_A"]
    h = hits[1]
    assert (h.aligned_cols, h.sum_probs) == (20, 11.0)
    assert h.indices_query[0] == 10 and h.indices_hit[0] == 31  # "Q query 11 ..." / "T 2CRB_A 32 ..."
    assert QUERY[10:30] == h.query


def test_hhr_gapped_alignment_indices():
    text = (
        "Query         q\n\nNo 1\n>1ABC_A something\n"
        "Probab=99.0  E-value=1e-5  Score=50.0  Aligned_cols=4  Identities=50%  Similarity=0.5  Sum_probs=3.5\n\n"
        "Q q                 2 AK-TA    5 (10)\nT 1ABC_A           7 A-GTA   10 (40)\n"
    )
    (hit,) = parse_hhr(text)
    assert hit.indices_query == [1, 2, -1, 3, 4]
    assert hit.indices_hit == [6, -1, 7, 8, 9]


# ----------------------------------------------------------------------------------------------- mmCIF, templates


def test_mmcif_chain_and_release_date():
    f = parse_mmcif((ASSETS / "mmcifs" / "4zey.cif").read_text(), "4zey.cif")
    assert f.release_date == "2015-05-06"
    chain = f.chains["A"]
    assert chain.positions.shape == (len(chain.sequence), 37, 3)
    present = chain.mask[:, rc.atom_order["CA"]] > 0
    ca = chain.positions[present, rc.atom_order["CA"]]
    gaps = np.linalg.norm(np.diff(ca, axis=0), axis=-1)
    assert np.median(gaps) == pytest.approx(3.8, abs=0.05)  # real coordinates, consecutive residues
    assert "SD" in [rc.atom_types[j] for j in np.nonzero(chain.mask.max(0))[0]]  # MSE read as MET


def test_mmcif_quoted_values_that_look_like_names():
    text = (
        "data_x\nloop_\n_a.k\n_a.v\n1 '_not_a_name'\n#\nloop_\n_atom_site.id\n_atom_site.auth_asym_id\n"
        "_atom_site.label_seq_id\n_atom_site.label_atom_id\n_atom_site.label_comp_id\n_atom_site.Cartn_x\n"
        "_atom_site.Cartn_y\n_atom_site.Cartn_z\n1 A 1 CA GLY 1.0 2.0 3.0\n#\n"
        "loop_\n_pdbx_poly_seq_scheme.pdb_strand_id\n"
        "_pdbx_poly_seq_scheme.seq_id\n_pdbx_poly_seq_scheme.mon_id\nA 1 GLY\n#\n"
    )
    f = parse_mmcif(text)
    assert f.chains["A"].sequence == "G"
    assert f.chains["A"].positions[0, rc.atom_order["CA"]].tolist() == [1.0, 2.0, 3.0]


def test_mmcif_microheterogeneity_keeps_one_residue_per_position():
    """Two residue types modelled at seq id 2 (SER listed first, then ALA, each with its own atoms in alternate
    locations): the SEQRES keeps one letter per position (the first listed) and only that residue's atoms."""
    text = (
        "data_x\nloop_\n_pdbx_poly_seq_scheme.pdb_strand_id\n_pdbx_poly_seq_scheme.seq_id\n"
        "_pdbx_poly_seq_scheme.mon_id\nA 1 GLY\nA 2 SER\nA 2 ALA\nA 3 MET\n#\n"
        "loop_\n_atom_site.id\n_atom_site.auth_asym_id\n_atom_site.label_seq_id\n_atom_site.label_atom_id\n"
        "_atom_site.label_comp_id\n_atom_site.label_alt_id\n_atom_site.Cartn_x\n_atom_site.Cartn_y\n"
        "_atom_site.Cartn_z\n"
        "1 A 1 CA GLY . 1.0 0 0\n2 A 2 CA ALA B 9.0 0 0\n3 A 2 CB ALA B 9.0 0 0\n4 A 2 CA SER A 2.0 0 0\n"
        "5 A 2 OG SER A 2.5 0 0\n6 A 3 CA MET . 3.0 0 0\n#\n"
    )
    chain = parse_mmcif(text, "hetero.cif").chains["A"]
    assert chain.sequence == "GSM"
    assert chain.positions[1, rc.atom_order["CA"], 0] == 2.0  # SER's CA, not ALA's (listed before it)
    assert {rc.atom_types[j] for j in np.nonzero(chain.mask[1])[0]} == {"CA", "OG"}
    assert chain.positions[2, rc.atom_order["CA"], 0] == 3.0


def test_templates_from_hits_with_missing_files_and_date_cutoff(caplog):
    hits = parse_hhr((ALIGN / "pdb70_hits.hhr").read_text())
    feats = TemplateFeaturizer(TemplateConfig(mmcif_dir=str(ASSETS / "mmcifs"), max_template_date="2021-01-01"))
    out = feats.get(QUERY, hits)
    assert out["template_aatype"].shape == (3, len(QUERY))  # 4ZEY, 3ZEE, 4I6P; the others have no file
    assert "no 1hf9.cif" in caplog.text
    hit = next(h for h in hits if h.name == "4ZEY_A")
    k = [i for i in range(3) if np.isclose(out["template_sum_probs"][i, 0], hit.sum_probs, rtol=1e-6)][0]
    covered = np.nonzero(out["template_all_atom_mask"][k].sum(-1))[0]
    assert set(covered) <= {q for q in hit.indices_query if q >= 0} and len(covered) > 10
    seq = "".join(rc.restypes_with_x[a] if a < 21 else "-" for a in out["template_aatype"][k])
    assert seq[covered[0] : covered[0] + 5] == hit.hit_sequence.replace("-", "")[:5]
    early = TemplateFeaturizer(TemplateConfig(mmcif_dir=str(ASSETS / "mmcifs"), max_template_date="2014-01-01"))
    assert early.get(QUERY, hits)["template_aatype"].shape[0] == 2  # 4ZEY (2015) is after the cut-off


# ----------------------------------------------------------------------------------------------- processed batch


def _raw(msas=()):
    return {
        **make_sequence_features(QUERY),
        **make_msa_features(QUERY, list(msas)),
        **empty_template_features(len(QUERY)),
    }


def test_processed_batch_shapes_and_recycling_axis():
    msa = parse_a3m((ALIGN / "bfd_uniclust_hits.a3m").read_text())
    cfg = FeatureConfig(max_msa_clusters=16, max_extra_msa=40, max_templates=4, num_recycle=2)
    batch = process_features(_raw([msa]), cfg, seed=1)
    n, r = len(QUERY), 3
    expected = {
        "aatype": (n, r),
        "residue_index": (n, r),
        "seq_mask": (n, r),
        "target_feat": (n, 22, r),
        "msa_feat": (16, n, 49, r),
        "msa_mask": (16, n, r),
        "extra_msa": (40, n, r),
        "extra_msa_mask": (40, n, r),
        "extra_has_deletion": (40, n, r),
        "extra_deletion_value": (40, n, r),
        "template_aatype": (0, n, r),
        "template_all_atom_positions": (0, n, 37, 3, r),
        "template_mask": (0, r),
        "atom14_atom_exists": (n, 14, r),
        "residx_atom14_to_atom37": (n, 14, r),
        "residx_atom37_to_atom14": (n, 37, r),
        "atom37_atom_exists": (n, 37, r),
    }
    for key, shape in expected.items():
        assert batch[key].shape == shape, key
    feat = batch["msa_feat"]
    np.testing.assert_allclose(feat[..., :23, :].sum(-2), 1.0)  # one-hot cluster MSA
    np.testing.assert_allclose(feat[..., 25:48, :].sum(-2), 1.0, atol=1e-5)  # cluster profile sums to 1
    assert not np.array_equal(feat[..., 0], feat[..., 1])  # each pass samples its own MSA
    np.testing.assert_array_equal(process_features(_raw([msa]), cfg, seed=1)["msa_feat"], feat)  # deterministic
    aatype = batch["aatype"][:, 0]
    np.testing.assert_array_equal(batch["target_feat"][np.arange(n), 1 + aatype, 0], 1.0)
    np.testing.assert_array_equal(batch["atom37_atom_exists"][..., 0], rc.restype_atom37_mask[aatype])


def test_single_sequence_batch_has_a_masked_extra_row():
    batch = process_features(_raw(), FeatureConfig(num_recycle=0, masked_msa_replace_fraction=0.0), seed=0)
    assert batch["msa_feat"].shape[0] == 1
    np.testing.assert_array_equal(batch["msa_feat"][0, :, :21, 0].argmax(-1), batch["aatype"][:, 0])
    assert batch["extra_msa_mask"].shape[0] == 1 and batch["extra_msa_mask"].sum() == 0


def test_feature_config_validates():
    with pytest.raises(ValueError, match="max_msa_clusters"):
        FeatureConfig(max_msa_clusters=0)


# ----------------------------------------------------------------------------------------------- tools


def test_jackhmmer_on_a_database_the_test_builds(tmp_path):
    from lowmem.fastfold.data.tools import ToolError, find_binary, run_jackhmmer

    try:
        jackhmmer = find_binary(None, "jackhmmer")
    except ToolError:
        pytest.skip("jackhmmer not installed (pip install hmmer, or apt-get install -y hmmer)")

    rng = np.random.default_rng(0)
    letters = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    homologs = []
    for k in range(6):
        seq = np.array(list(QUERY))
        flip = rng.random(len(seq)) < 0.1 * (k + 1) / 2
        seq[flip] = rng.choice(letters, flip.sum())
        homologs.append("".join(seq))
    decoys = ["".join(rng.choice(letters, 80)) for _ in range(20)]
    db = tmp_path / "db.fasta"
    db.write_text(
        "".join(f">hom{k}\n{s}\n" for k, s in enumerate(homologs))
        + "".join(f">decoy{k}\n{s}\n" for k, s in enumerate(decoys))
    )
    out = tmp_path / "uniref90_hits.sto"
    run_jackhmmer(jackhmmer, QUERY, str(db), out, cpus=1)
    msa = parse_stockholm(out.read_text())
    names = {d.split("/")[0] for d in msa.descriptions}
    assert {f"hom{k}" for k in range(4)} <= names
    assert not any(n.startswith("decoy") for n in names)
    assert msa.sequences[0] == QUERY


def test_template_hit_differing_from_seqres_is_realigned_with_kalign(caplog):
    import dataclasses
    import logging

    hits = [h for h in parse_hhr((ALIGN / "pdb70_hits.hhr").read_text()) if h.name == "4ZEY_A"]
    # the deposited chain differs from the hit at one residue: str.find fails, kalign places it
    mutated = dataclasses.replace(hits[0], hit_sequence="W" + hits[0].hit_sequence[1:])
    cfg = dict(mmcif_dir=str(ASSETS / "mmcifs"), max_template_date="2021-01-01")
    exact = TemplateFeaturizer(TemplateConfig(**cfg)).get(QUERY, hits)
    without = TemplateFeaturizer(TemplateConfig(**cfg, kalign_binary_path=None)).get(QUERY, [mutated])
    assert without["template_aatype"].shape[0] == 0 and "no kalign" in caplog.text
    from lowmem.fastfold.data.tools import ToolError, find_binary

    try:
        find_binary(None, "kalign")
    except ToolError:
        pytest.skip("kalign not installed (apt-get install -y kalign)")
    with caplog.at_level(logging.INFO):
        realigned = TemplateFeaturizer(TemplateConfig(**cfg)).get(QUERY, [mutated])
    assert "realigned" in caplog.text
    np.testing.assert_array_equal(realigned["template_all_atom_positions"], exact["template_all_atom_positions"])


def test_stockholm_reference_line_defines_insert_columns():
    # jackhmmer output without the query row: the RF line marks the match states
    text = "# STOCKHOLM 1.0\nh1  MKgTAY\nh2  MK-TA-\n#=GC RF xx.xxx\n//\n"
    msa = parse_stockholm(text)
    assert msa.sequences == ["MKTAY", "MKTA-"]
    assert msa.deletion_matrix[0] == [0, 0, 1, 0, 0]
