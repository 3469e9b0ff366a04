"""AlphaFold-Multimer's data side on hand-worked examples: complex FASTA input (ColabFold and OpenFold forms, bad
input), homomer ids, MSA pairing by species from small hand-written `uniprot_hits.sto`, the merged MSA layout
(paired block, block-diagonal unpaired rows with gap fill, deduplication, crop) and per-chain templates."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.data.features import FeatureConfig
from lowmem.fastfold.data.msa_pairing import (
    MSA_GAP,
    MultimerFeatureConfig,
    block_diag,
    pair_and_merge,
    pair_sequences,
    reorder_paired_rows,
    species_identifier,
)
from lowmem.fastfold.data.multimer import (
    complex_raw_features,
    multimer_msa_sizes,
    nearest_neighbor_clusters,
    pairing_msa_features,
    parse_complex_fasta,
    process_multimer_features,
    read_complexes,
)
from lowmem.fastfold.data.parsers import InputError, Msa, parse_hhr, parse_stockholm
from lowmem.fastfold.data.targets import AlignmentConfig
from lowmem.fastfold.data.templates import TemplateConfig, TemplateFeaturizer

ASSETS = Path(__file__).parents[1] / "assets" / "multimer"
FOLD_ASSETS = Path(__file__).parents[1] / "assets" / "fold"
NO_PAD = MultimerFeatureConfig(min_num_seq=0)


def _ids(rows: list[str]) -> np.ndarray:
    """Hand-written MSA rows -> our residue indices (gap 21)."""
    return np.array([[MSA_GAP if c == "-" else rc.restype_order[c] for c in r] for r in rows], np.int64)


def _hetero_features(tmp_path: Path, fasta: str = "hetero.fasta", config: MultimerFeatureConfig = NO_PAD):
    (cplx,) = read_complexes(ASSETS / fasta)
    cfg = AlignmentConfig(precomputed_dir=str(ASSETS / "alignments"))
    info: dict = {}
    return complex_raw_features(cplx, cfg, tmp_path, config, info=info), info


# ------------------------------------------------------------------------------------------------ input


def test_colabfold_and_openfold_forms_give_the_same_complex():
    (colab,) = read_complexes(ASSETS / "hetero.fasta")
    (openfold,) = read_complexes(ASSETS / "hetero_openfold.fasta")
    assert colab.name == "hetero" and openfold.name == "hetero_openfold"
    for cplx in (colab, openfold):
        assert [(c.name, c.sequence, c.chain_id, c.entity_id, c.sym_id) for c in cplx.chains] == [
            ("hetero_A", "MKTAYIA", "A", 1, 1),
            ("hetero_B", "GSHML", "B", 2, 1),
        ]


def test_homomer_parts_share_entity_and_count_sym_ids_in_feature_order():
    cplx = parse_complex_fasta(">c\nMKT:gsh:MKT:MKT\n", "c.fasta")
    assert [(c.chain_id, c.entity_id, c.sym_id) for c in cplx.chains] == [
        ("A", 1, 1), ("B", 2, 1), ("C", 1, 2), ("D", 1, 3)
    ]
    # AlphaFold-Multimer groups the chains by entity: asym_id 1..4 goes to A, C, D, B
    assert [c.chain_id for c in cplx.feature_order()] == ["A", "C", "D", "B"]
    assert not cplx.is_homomer and parse_complex_fasta(">h\nMKT:MKT\n").is_homomer


def test_one_record_without_separator_is_a_one_chain_complex_named_like_a_monomer():
    cplx = parse_complex_fasta(">mono\nMKTAY\n", "m.fasta")
    assert [(c.name, c.chain_id, c.entity_id, c.sym_id) for c in cplx.chains] == [("mono", "A", 1, 1)]


def _esc(s: str) -> str:
    return s.replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (">c\nMKT::GSH\n", "c.fasta: record 1 (c, line 1): chain 2 of 3 is empty"),
        (">c\nMKT:\n", "c.fasta: record 1 (c, line 1): chain 2 of 2 is empty"),
        (">c\n:MKT\n", "c.fasta: record 1 (c, line 1): chain 1 of 2 is empty"),
        (">c\nMKT:GS/HH\n", "c.fasta: record 1 (c, line 1): mixed chain separators ':' and '/'"),
        (">c\nMKT/GSH\n", "c.fasta: record 1 (c, line 1): '/' is not a chain separator"),
        (">a\nMKT\n>b\nGG:HH\n", "c.fasta: record 2 (b, line 3): chain separator ':' in a file of 2 records"),
        (">a\nMKT\n>b\n\n>c\nGG\n", "c.fasta: record 2 (b, line 3): empty chain"),
        (">a\nMKT\n>a\nGG\n", "c.fasta: record 2 (a, line 3): duplicate chain name 'a'"),
        (">c\nMK1:GG\n", "c.fasta: record 1 (c, line 1): chain 1: position 3: '1' is not an amino-acid letter"),
        (">\nMKT:GG\n", "c.fasta: record 1 (unnamed, line 1): empty header"),
        ("MKT:GG\n", "c.fasta: line 1: not FASTA"),
    ],
)
def test_bad_complex_input_is_one_line_naming_file_and_record(text, message):
    with pytest.raises(InputError, match="^" + _esc(message)) as err:
        parse_complex_fasta(text, "c.fasta")
    assert "\n" not in str(err.value)


def test_bad_complex_file_is_named_with_its_path(tmp_path):
    bad = tmp_path / "dimer.fasta"
    bad.write_text(">x\nMKTAY:\n")
    with pytest.raises(InputError, match=f"^{bad}: record 1 \\(x, line 1\\): chain 2 of 2 is empty"):
        read_complexes(bad)
    (tmp_path / "other.fa").write_text(">x\nGG\n")
    bad.write_text(">x\nMKT:GG\n")
    with pytest.raises(InputError, match="complex 'x' is also in"):
        read_complexes(tmp_path)


# ------------------------------------------------------------------------------------------------ species


def test_species_from_uniprot_names_and_none_from_other_names():
    assert species_identifier("tr|A0A001|A0A001_HUMAN/1-7") == "HUMAN"
    assert species_identifier("sp|Q00006|ABC_ECOLI/1-6 some description") == "ECOLI"
    assert species_identifier("tr|A0A0A0MRZ7_1|A0A0A0MRZ7_9BACT_12/3-90") == "9BACT"
    for name in ("hetero_A", "UniRef90_A0A005/1-7", "MGYP000406148242/1-68", ""):
        assert species_identifier(name) == ""
    # a real jackhmmer result (UniRef90 names) has nothing to pair on
    real = parse_stockholm((FOLD_ASSETS / "alignments/query/uniref90_hits.sto").read_text())
    assert len(real) > 50 and {species_identifier(d) for d in real.descriptions} == {""}


def test_pairing_msa_features_query_first_duplicates_dropped():
    msa = parse_stockholm((ASSETS / "alignments/hetero_B/uniprot_hits.sto").read_text())
    feats = pairing_msa_features("GSHML", msa)
    assert feats["msa_all_seq"].tolist() == _ids(["GSHML", "GSHMV", "GAHMV", "GSHLL", "GSAML", "GAHML"]).tolist()
    assert list(feats["msa_species_identifiers_all_seq"]) == ["", "MOUSE", "HUMAN", "ECOLI", "DROME", "HUMAN"]
    assert feats["deletion_matrix_all_seq"].shape == (6, 5)


# ------------------------------------------------------------------------------------------------ pairing


def _chain(query: str, rows: list[tuple[str, str]]) -> dict:
    msa = Msa([query] + [r for r, _ in rows], [[0] * len(query)] * (len(rows) + 1), ["q"] + [d for _, d in rows])
    return pairing_msa_features(query, msa)


def test_pairing_two_chains_by_hand():
    """A: HUMAN x2 (rows 1, 2), MOUSE 3, YEAST 4 (only in A), ECOLI 6; B: MOUSE 1, HUMAN x2 (rows 2, 5), ECOLI 3,
    DROME 4 (only in B). HUMAN pairs rank by rank (A's best 2 with B's best 5, then 1 with 2); rows are ordered
    by the product of their indices: [0,0] 0, [1,2] 2, [3,1] 3, [2,5] 10, [6,3] 18."""
    a = pairing_msa_features("MKTAYIA", parse_stockholm((ASSETS / "alignments/hetero_A/uniprot_hits.sto").read_text()))
    b = pairing_msa_features("GSHML", parse_stockholm((ASSETS / "alignments/hetero_B/uniprot_hits.sto").read_text()))
    paired = pair_sequences([a, b])
    assert sorted(map(tuple, paired[2].tolist())) == [(0, 0), (1, 2), (2, 5), (3, 1), (6, 3)]
    assert reorder_paired_rows(paired).tolist() == [[0, 0], [1, 2], [3, 1], [2, 5], [6, 3]]


def test_pairing_three_chains_gap_rows_and_species_cap():
    x = _chain("AAAA", [("AAAC", "tr|X00001|X00001_HUMAN"), ("AACC", "tr|X00002|X00002_MOUSE")])
    y = _chain("CCCC", [("CCCA", "tr|Y00001|Y00001_HUMAN"), ("CCAA", "tr|Y00002|Y00002_MOUSE")])
    z = _chain("DDDD", [("DDDA", "tr|Z00001|Z00001_HUMAN")])
    rows = reorder_paired_rows(pair_sequences([x, y, z]))
    # rows covering all three chains first; MOUSE is missing from z: its row there is the gap row (-1)
    assert rows.tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, -1]]
    chains = [_with_ids(c, q, k + 1) for k, (c, q) in enumerate(zip([x, y, z], ["AAAA", "CCCC", "DDDD"]))]
    merged = pair_and_merge(chains, NO_PAD)
    assert merged["msa"][:3].tolist() == _ids(["AAAACCCCDDDD", "AAACCCCADDDA", "AACCCCAA----"]).tolist()
    # a species with more rows than the cap in any chain is not paired
    x2 = _chain("AAAA", [("AAAC", "tr|X00001|X00001_HUMAN"), ("AACA", "tr|X00003|X00003_HUMAN"),
                         ("AACC", "tr|X00002|X00002_MOUSE")])
    assert reorder_paired_rows(pair_sequences([x2, y], max_rows_per_species=1)).tolist() == [[0, 0], [3, 2]]


def _with_ids(pairing: dict, query: str, entity: int, asym: int | None = None, sym: int = 1) -> dict:
    n = len(query)
    return {
        "aatype": _ids([query])[0], "residue_index": np.arange(n), "msa": _ids([query]),
        "deletion_matrix": np.zeros((1, n), np.float32), **pairing,
        "asym_id": np.full(n, asym or entity), "entity_id": np.full(n, entity), "sym_id": np.full(n, sym),
        "template_aatype": np.zeros((0, n), np.int64),
        "template_all_atom_positions": np.zeros((0, n, 37, 3), np.float32),
        "template_all_atom_mask": np.zeros((0, n, 37), np.float32),
    }


# ------------------------------------------------------------------------------------------------ merged features


HETERO_MSA = [
    "MKTAYIA" + "GSHML",  # paired: the queries
    "MKTGGIA" + "GAHMV",  # HUMAN, A's second with B's second
    "MKSAYIA" + "GSHMV",  # MOUSE
    "MKTAYIV" + "GAHML",  # HUMAN, the best of each
    "MKTAY-A" + "GSHLL",  # ECOLI
    "MRTAYLA" + "-----",  # A unpaired (MKTAYIA, MKTAYIV dropped: already paired)
    "MKTAYQA" + "-----",  # A unpaired, from the A3M (2 residues inserted before column 4)
    "-------" + "GSWML",  # B unpaired (GSHML, GSHMV dropped)
]


def test_heterodimer_features_by_hand(tmp_path):
    feats, info = _hetero_features(tmp_path)
    assert feats["msa"].tolist() == _ids(HETERO_MSA).tolist()
    dels = np.zeros((8, 12), np.float32)
    dels[6, 3] = 2.0
    np.testing.assert_array_equal(feats["deletion_matrix"], dels)
    bert = np.ones((8, 12), np.float32)
    bert[5:7, 7:] = 0.0
    bert[7, :7] = 0.0
    np.testing.assert_array_equal(feats["bert_mask"], bert)
    np.testing.assert_array_equal(feats["msa_mask"], np.ones((8, 12), np.float32))
    assert feats["cluster_bias_mask"].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert feats["asym_id"].tolist() == [1] * 7 + [2] * 5
    assert feats["entity_id"].tolist() == [1] * 7 + [2] * 5
    assert feats["sym_id"].tolist() == [1] * 12
    assert feats["residue_index"].tolist() == list(range(7)) + list(range(5))
    # deletion_mean over each chain's unpaired MSA before deduplication (A: 4 rows, one with 2 deletions)
    np.testing.assert_allclose(feats["deletion_mean"], [0, 0, 0, 0.5, 0, 0, 0] + [0] * 5)
    assert int(feats["num_alignments"]) == 8 and int(feats["num_paired_rows"]) == 5
    assert [c["residues"] for c in info["chains"]] == [[0, 7], [7, 12]]
    assert info["chains"][0]["alignment_files"] == ["uniref90_hits.sto", "bfd_uniclust_hits.a3m"]


def test_heterodimer_shapes_and_dtypes_both_forms(tmp_path):
    feats, _ = _hetero_features(tmp_path, config=MultimerFeatureConfig())  # AlphaFold's defaults: 512 rows
    other, _ = _hetero_features(tmp_path, "hetero_openfold.fasta", MultimerFeatureConfig())
    n, s = 12, 512
    expected = {
        "aatype": ((n,), np.int64), "residue_index": ((n,), np.int64), "asym_id": ((n,), np.int64),
        "entity_id": ((n,), np.int64), "sym_id": ((n,), np.int64), "entity_mask": ((n,), np.int64),
        "seq_mask": ((n,), np.float32), "deletion_mean": ((n,), np.float32),
        "msa": ((s, n), np.int64), "deletion_matrix": ((s, n), np.float32), "msa_mask": ((s, n), np.float32),
        "bert_mask": ((s, n), np.float32), "cluster_bias_mask": ((s,), np.float32),
        "template_aatype": ((4, n), np.int64), "template_all_atom_positions": ((4, n, 37, 3), np.float32),
        "template_all_atom_mask": ((4, n, 37), np.float32), "template_mask": ((4,), np.float32),
    }
    for key, (shape, dtype) in expected.items():
        assert feats[key].shape == shape and feats[key].dtype == dtype, key
        np.testing.assert_array_equal(feats[key], other[key], err_msg=key)
    # padding rows are masked out everywhere; the real rows are unchanged
    assert feats["msa_mask"][8:].sum() == 0 and feats["bert_mask"][8:].sum() == 0
    assert feats["msa"][:8].tolist() == _ids(HETERO_MSA).tolist()
    assert int(feats["num_alignments"]) == 8 and int(feats["seq_length"]) == n
    assert int(feats["assembly_num_chains"]) == 2 and int(feats["num_templates"]) == 0


def test_crop_keeps_half_paired_and_caps_unpaired_per_chain(tmp_path):
    # msa_crop_size 4: 2 paired rows; each chain keeps at most 4 - 2 unpaired rows (A has 2, B has 1)
    feats, _ = _hetero_features(tmp_path, config=MultimerFeatureConfig(msa_crop_size=4, min_num_seq=0))
    assert feats["msa"].tolist() == _ids(HETERO_MSA[:2] + HETERO_MSA[5:]).tolist()
    # msa_crop_size 3: 1 paired row, 2 unpaired rows per chain at most
    feats, _ = _hetero_features(tmp_path, config=MultimerFeatureConfig(msa_crop_size=3, min_num_seq=0))
    assert feats["msa"].tolist() == _ids(HETERO_MSA[:1] + HETERO_MSA[5:]).tolist()


def _copy_chain(tmp_path: Path, src: str, dst: str) -> Path:
    root = tmp_path / "alignments"
    shutil.copytree(ASSETS / "alignments" / src, root / dst)
    return root


def test_homodimer_unpaired_msas_side_by_side_no_folder_for_the_copy(tmp_path):
    root = _copy_chain(tmp_path, "hetero_A", "homo_A")  # homo_B has no folder: copies reuse the first's features
    cplx = parse_complex_fasta(">homo\nMKTAYIA:MKTAYIA\n", "homo.fasta")
    feats = complex_raw_features(cplx, AlignmentConfig(precomputed_dir=str(root)), tmp_path, NO_PAD)
    rows = ["MKTAYIA", "MKTAYIV", "MRTAYLA", "MKTAYQA"]  # no pairing for a homomer: query kept
    assert feats["msa"].tolist() == _ids([r + r for r in rows]).tolist()
    assert feats["deletion_matrix"][3].tolist() == [0, 0, 0, 2, 0, 0, 0] * 2
    assert feats["asym_id"].tolist() == [1] * 7 + [2] * 7
    assert feats["sym_id"].tolist() == [1] * 7 + [2] * 7
    assert feats["entity_id"].tolist() == [1] * 14
    assert feats["cluster_bias_mask"].tolist() == [1, 0, 0, 0]
    np.testing.assert_array_equal(feats["bert_mask"], np.ones((4, 14), np.float32))


def test_a2b_copies_side_by_side_entities_block_diagonal(tmp_path):
    root = _copy_chain(tmp_path, "hetero_A", "abc_A")
    shutil.copytree(ASSETS / "alignments/hetero_B", root / "abc_B")
    cplx = parse_complex_fasta(">abc\nMKTAYIA:GSHML:MKTAYIA\n", "abc.fasta")
    feats = complex_raw_features(cplx, AlignmentConfig(precomputed_dir=str(root)), tmp_path, NO_PAD)
    # feature order A, C (entity 1), B (entity 2); A's columns appear twice in every row. YEAST, in A only, is now
    # in two chains (A and its copy C): it becomes a paired row with a gap row for B, after the rows in all three
    expected = [r[:7] + r[:7] + r[7:] for r in HETERO_MSA]
    assert feats["msa"].tolist() == _ids(expected).tolist()
    assert int(feats["num_paired_rows"]) == 6
    bert = np.ones((8, 19), np.float32)
    bert[6, 14:] = 0.0  # A's remaining unpaired row (the A3M one), both copies
    bert[7, :14] = 0.0  # B's unpaired row
    np.testing.assert_array_equal(feats["bert_mask"], bert)
    assert feats["asym_id"].tolist() == [1] * 7 + [2] * 7 + [3] * 5
    assert feats["sym_id"].tolist() == [1] * 7 + [2] * 7 + [1] * 5
    assert feats["entity_id"].tolist() == [1] * 14 + [2] * 5


def test_pairing_and_hmmsearch_files_stay_out_of_the_unpaired_msa(tmp_path, caplog):
    root = _copy_chain(tmp_path, "hetero_A", "hetero_A")
    shutil.copytree(ASSETS / "alignments/hetero_B", root / "hetero_B")
    # hmmsearch template hits (AlphaFold-Multimer's pdb_hits.sto, OpenFold's hmm_output.sto) have other widths
    hmm = "# STOCKHOLM 1.0\n\n1abc_A/1-3 MKTAYIAGGG\n//\n"
    (root / "hetero_A/pdb_hits.sto").write_text(hmm)
    (root / "hetero_B/hmm_output.sto").write_text(hmm)
    (cplx,) = read_complexes(ASSETS / "hetero.fasta")
    feats = complex_raw_features(cplx, AlignmentConfig(precomputed_dir=str(root)), tmp_path, NO_PAD)
    assert feats["msa"].tolist() == _ids(HETERO_MSA).tolist()
    assert "pdb_hits.sto not used" in caplog.text and "hmm_output.sto not used" in caplog.text


def test_single_sequence_heterodimer_is_the_paired_query_row(tmp_path):
    (cplx,) = read_complexes(ASSETS / "hetero.fasta")
    feats = complex_raw_features(cplx, AlignmentConfig(single_sequence=True), tmp_path, NO_PAD)
    assert feats["msa"].tolist() == _ids(["MKTAYIAGSHML"]).tolist()
    assert feats["cluster_bias_mask"].tolist() == [1.0]


def test_block_diag_fills_off_diagonal():
    out = block_diag(np.ones((2, 1), np.int64), 2 * np.ones((1, 3), np.int64), pad_value=MSA_GAP)
    assert out.tolist() == [[1, 21, 21, 21], [1, 21, 21, 21], [21, 2, 2, 2]]


# ------------------------------------------------------------------------------------------------ templates


def test_templates_per_chain_in_their_residue_range(tmp_path):
    query = (FOLD_ASSETS / "query.fasta").read_text().split("\n")[1]
    root = tmp_path / "alignments"
    (root / "query").mkdir(parents=True)
    shutil.copy(FOLD_ASSETS / "alignments/query/pdb70_hits.hhr", root / "query")
    shutil.copytree(ASSETS / "alignments/hetero_B", root / "hetero_B")
    fasta = tmp_path / "tq.fasta"
    fasta.write_text(f">hetero_B\nGSHML\n>query\n{query}\n")
    (cplx,) = read_complexes(fasta)
    cfg = AlignmentConfig(precomputed_dir=str(root), template_mmcif_dir=str(FOLD_ASSETS / "mmcifs"),
                          max_template_date="2021-01-01", kalign_binary_path="")
    feats = complex_raw_features(cplx, cfg, tmp_path, NO_PAD)
    hits = parse_hhr((root / "query/pdb70_hits.hhr").read_text())
    ref = TemplateFeaturizer(TemplateConfig(mmcif_dir=str(FOLD_ASSETS / "mmcifs"), max_template_date="2021-01-01",
                                            kalign_binary_path=None)).get(query, hits)
    t = len(ref["template_aatype"])
    assert 0 < t < 4
    n_b = 5  # chain B (input order first, entity 1) has no template hits: its columns are zero in every row
    for key in ("template_aatype", "template_all_atom_positions", "template_all_atom_mask"):
        np.testing.assert_array_equal(feats[key][:t, n_b:], ref[key], err_msg=key)
        assert not feats[key][t:].any() and not feats[key][:, :n_b].any(), key
    assert feats["template_mask"].tolist() == [1.0] * t + [0.0] * (4 - t)
    # at most max_templates per chain
    capped = complex_raw_features(cplx, cfg, tmp_path, MultimerFeatureConfig(max_templates=1, min_num_seq=0))
    assert capped["template_aatype"].shape == (1, n_b + len(query))
    np.testing.assert_array_equal(capped["template_aatype"][0, n_b:], ref["template_aatype"][0])


def test_pairing_requires_alignments_only_for_heteromers():
    with pytest.raises(ValueError, match="no pairing MSA"):
        a = _with_ids({}, "MKT", 1)
        b = _with_ids({}, "GSH", 2)
        pair_and_merge([a, b], NO_PAD)
    # a monomer or homomer needs none
    merged = pair_and_merge([_with_ids({}, "MKT", 1), _with_ids({}, "MKT", 1, asym=2, sym=2)], NO_PAD)
    assert merged["msa"].tolist() == _ids(["MKTMKT"]).tolist()



# ------------------------------------------------------------------------------------------------ OpenFold parity


_REFERENCE_CASES = {
    "hetero": (">hetero_A\nMKTAYIA\n>hetero_B\nGSHML\n", ASSETS / "alignments", 2048),
    "a2b": (">hetero_A\nMKTAYIA\n>hetero_B\nGSHML\n>hetero_A2\nMKTAYIA\n", ASSETS / "alignments", 2048),
    "homo": (">hetero_A\nMKTAYIA\n>copy\nMKTAYIA\n", ASSETS / "alignments", 2048),
    "random_a2bc_crop2048": (None, ASSETS / "random_a2bc", 2048),
    "random_a2bc_crop40": (None, ASSETS / "random_a2bc", 40),
}


@pytest.mark.parametrize("case", sorted(_REFERENCE_CASES))
def test_features_equal_openfold_data_pipeline_multimer(case, tmp_path):
    """Arrays written by OpenFold's `DataPipelineMultimer.process_fasta` on the same files (see the assets' README;
    for the random case with stable sorts, as ties in similarity or row product are ordered by numpy's unstable
    quicksort there). Every feature both sides have must be equal, padding to 512 rows included."""
    text, root, crop = _REFERENCE_CASES[case]
    ref = np.load(ASSETS / "openfold_reference" / f"{case}.npz")
    if text is None:
        (cplx,) = read_complexes(root / "complex.fasta")
    else:
        cplx = parse_complex_fasta(text, f"{case}.fasta")
    ours = complex_raw_features(cplx, AlignmentConfig(precomputed_dir=str(root)), tmp_path,
                                MultimerFeatureConfig(msa_crop_size=crop))
    assert len(ref.files) >= 20
    for key in ref.files:
        assert ours[key].shape == ref[key].shape, key
        np.testing.assert_array_equal(ours[key], ref[key].astype(ours[key].dtype), err_msg=key)


# ------------------------------------------------------------------------------------------------ processed batch


def test_nearest_neighbor_clusters_by_hand():
    """Centres AR and ND; an extra row agreeing equally with both is split half-half, and (as in AlphaFold-Multimer)
    each assignment is scaled by the residues unmasked in both rows (2 here)."""
    msa, mask, dels = _ids(["AR", "ND"]), np.ones((2, 2), np.float32), np.zeros((2, 2), np.float32)
    extra_dels = np.array([[2.0, 0.0]], np.float32)
    one = np.ones((1, 2), np.float32)
    profile, del_mean = nearest_neighbor_clusters(msa, mask, dels, _ids(["AD"]), one, extra_dels)
    a, r, n, d = (rc.restype_order[c] for c in "ARND")
    assert profile[0, 0, a] == pytest.approx(1.0) and profile[0, 1, r] == pytest.approx(0.5)
    assert profile[0, 1, d] == pytest.approx(0.5) and profile[1, 0, n] == pytest.approx(0.5)
    np.testing.assert_allclose(del_mean, [[1.0, 0.0], [1.0, 0.0]], rtol=1e-6)
    # an extra row equal to centre 0: all to centre 0, weight 2, count 3
    profile, del_mean = nearest_neighbor_clusters(msa, mask, dels, _ids(["AR"]), one, extra_dels)
    assert profile[0, 0, a] == pytest.approx(1.0) and profile[1, 1, d] == pytest.approx(1.0)
    np.testing.assert_allclose(del_mean, [[4.0 / 3.0, 0.0], [0.0, 0.0]], rtol=1e-6)
    # gaps never count as agreement (weight 0), a masked extra row is assigned nowhere
    profile, _ = nearest_neighbor_clusters(msa, mask, dels, _ids(["AR"]), np.zeros((1, 2), np.float32), extra_dels)
    np.testing.assert_allclose(profile, np.eye(23, dtype=np.float32)[msa])


def test_processed_batch_shapes_query_rows_kept_and_deterministic(tmp_path):
    raw, _ = _hetero_features(tmp_path, config=MultimerFeatureConfig())  # 8 real rows, padded to 512
    cfg = FeatureConfig(max_msa_clusters=4, max_extra_msa=6, num_recycle=2)
    batch = process_multimer_features(raw, cfg, seed=3)
    n, r = 12, 3
    assert batch["msa_feat"].shape == (4, n, 49, r) and batch["extra_msa"].shape == (6, n, r)
    assert batch["target_feat"].shape == (n, 21, r) and batch["asym_id"].shape == (n, r)
    assert batch["template_aatype"].shape == (4, n, r)
    # the paired query row is always the first centre; every centre and extra row here is a real row
    np.testing.assert_array_equal(batch["true_msa"][0], np.repeat(raw["msa"][:1].T, r, axis=1))
    assert batch["msa_mask"].min() == 1 and batch["extra_msa_mask"][:4].min() == 1
    # 4 centres + 6 extra > 8 real rows: the last 2 extra rows are padding, fully masked
    assert batch["extra_msa_mask"][4:].sum() == 0
    sampled = {tuple(row) for p in range(r) for row in batch["true_msa"][..., p]}
    assert sampled <= {tuple(row) for row in raw["msa"][:8]}
    # corrupted only where chosen and allowed by the raw bert_mask; passes differ; the seed fixes everything
    assert batch["bert_mask"].max() == 1 and not np.array_equal(batch["true_msa"][..., 0], batch["true_msa"][..., 1])
    again = process_multimer_features(raw, cfg, seed=3)
    for key in batch:
        np.testing.assert_array_equal(batch[key], again[key], err_msg=key)


def test_processed_batch_without_corruption_is_the_sampled_msa(tmp_path):
    root = _copy_chain(tmp_path, "hetero_A", "homo_A")
    cplx = parse_complex_fasta(">homo\nMKTAYIA:MKTAYIA\n")
    raw = complex_raw_features(cplx, AlignmentConfig(precomputed_dir=str(root)), tmp_path, NO_PAD)
    cfg = FeatureConfig(max_msa_clusters=2, max_extra_msa=4, num_recycle=0, masked_msa_replace_fraction=0.0)
    batch = process_multimer_features(raw, cfg, seed=0)
    true = batch["true_msa"][..., 0]
    np.testing.assert_array_equal(batch["msa_feat"][..., :23, 0], np.eye(23)[true])
    assert batch["bert_mask"].sum() == 0
    assert true[0].tolist() == raw["msa"][0].tolist()  # the query: the one row of cluster_bias_mask
    np.testing.assert_allclose(batch["extra_deletion_value"][..., 0],
                               np.arctan(batch["extra_deletion_matrix"][..., 0] / 3.0) * 2 / np.pi, rtol=1e-6)


def test_multimer_msa_sizes_of_the_released_models():
    assert multimer_msa_sizes("model_1_multimer_v3") == (508, 2048)
    assert multimer_msa_sizes("model_5_multimer_v3") == (508, 1152)
    assert multimer_msa_sizes("model_2_multimer") == (252, 1152)
    with pytest.raises(InputError, match="model_1_ptm"):
        multimer_msa_sizes("model_1_ptm")
