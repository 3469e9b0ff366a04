"""PDB and mmCIF writers (parsed back with gemmi and Biopython), confidence JSON and plots."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.io.confidence import (
    confidence_dict,
    msa_coverage,
    plot_msa_coverage,
    plot_pae,
    plot_plddt,
    write_confidence_json,
)
from lowmem.fastfold.io.protein import Protein, from_pdb, to_mmcif, to_pdb
from lowmem.fastfold.model.testing import random_atom37

SEQUENCE = "MKTAYIAKQRWCGNPSEDHFLV"  # all 20 amino acids and then some


@pytest.fixture(scope="module")
def protein() -> Protein:
    aatype = torch.tensor([rc.restype_order[a] for a in SEQUENCE])
    pos, mask = random_atom37(aatype, torch.Generator().manual_seed(0))
    plddt = np.linspace(20.0, 95.0, len(SEQUENCE))
    return Protein(
        pos.numpy(),
        mask.numpy(),
        aatype.numpy(),
        np.arange(1, len(SEQUENCE) + 1),
        np.repeat(plddt[:, None], 37, axis=1),
    )


def _expected_atoms(aatype: int) -> set[str]:
    return {rc.atom_types[j] for j in np.nonzero(rc.restype_atom37_mask[aatype])[0]}


def test_pdb_parses_with_gemmi_with_atoms_and_plddt(protein, tmp_path):
    gemmi = pytest.importorskip("gemmi")
    path = tmp_path / "x.pdb"
    path.write_text(to_pdb(protein, remark="test"))
    structure = gemmi.read_structure(str(path))
    chain = structure[0]["A"]
    assert len(chain) == len(SEQUENCE)
    assert gemmi.one_letter_code([r.name for r in chain]) == SEQUENCE
    for i, residue in enumerate(chain):
        assert {a.name for a in residue} == _expected_atoms(protein.aatype[i])
        assert {round(a.b_iso, 2) for a in residue} == {round(protein.b_factors[i, 0], 2)}
        ca = residue["CA"][0].pos
        np.testing.assert_allclose([ca.x, ca.y, ca.z], protein.atom_positions[i, 1], atol=1e-3)


def test_mmcif_parses_with_biopython_with_atoms_and_plddt(protein, tmp_path):
    from Bio.PDB.MMCIFParser import MMCIFParser

    path = tmp_path / "x.cif"
    path.write_text(to_mmcif(protein, name="x"))
    structure = MMCIFParser(QUIET=True).get_structure("x", str(path))
    residues = list(structure[0]["A"])
    assert [rc.restype_3to1[r.get_resname()] for r in residues] == list(SEQUENCE)
    for i, residue in enumerate(residues):
        assert {a.get_id() for a in residue} == _expected_atoms(protein.aatype[i])
        assert residue["CA"].get_bfactor() == pytest.approx(protein.b_factors[i, 0], abs=0.01)


def test_pdb_round_trip(protein):
    back = from_pdb(to_pdb(protein))
    np.testing.assert_array_equal(back.aatype, protein.aatype)
    np.testing.assert_array_equal(back.atom_mask, protein.atom_mask)
    np.testing.assert_allclose(back.atom_positions, protein.atom_positions * protein.atom_mask[..., None], atol=1e-3)


def test_pdb_columns_are_fixed_width(protein):
    lines = [line for line in to_pdb(protein).splitlines() if line.startswith("ATOM")]
    assert all(len(line) == 80 for line in lines)
    assert lines[0][12:16] == " N  " and lines[0][17:20] == "MET" and lines[0][21] == "A"


def test_confidence_json_and_plots(tmp_path):
    rng = np.random.default_rng(0)
    plddt, pae = rng.uniform(0, 100, 7), rng.uniform(0, 30, (7, 7))
    conf = confidence_dict(plddt, ptm=0.61234, pae=pae)
    write_confidence_json(tmp_path / "c.json", conf)
    back = json.loads((tmp_path / "c.json").read_text())
    assert back["plddt"] == pytest.approx(plddt.tolist(), abs=0.01)
    assert back["mean_plddt"] == pytest.approx(plddt.mean(), abs=0.01)
    assert back["ptm"] == pytest.approx(0.6123)
    assert np.array(back["pae"]).shape == (7, 7)
    assert set(confidence_dict(plddt)) == {"plddt", "mean_plddt"}
    plot_plddt(tmp_path / "p.png", plddt, "t")
    plot_pae(tmp_path / "e.png", pae, "t")
    for name in ("p.png", "e.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_protein_validates_shapes(protein):
    with pytest.raises(ValueError, match="b_factors"):
        Protein(protein.atom_positions, protein.atom_mask, protein.aatype, protein.residue_index, np.zeros(3))


def test_pae_on_alphafolds_fixed_scale_and_the_random_weights_mark(tmp_path):
    """max_pae is AlphaFold's cap (31.75), not this matrix's maximum; a cell of 5 A has one colour whatever the
    matrix's maximum; "RANDOM WEIGHTS" is stamped in red across the plots it is asked for."""
    import matplotlib.image as mpimg

    small = np.full((12, 12), 5.0)
    large = small.copy()
    large[0, 0] = 10.0
    assert confidence_dict(np.full(12, 50.0), 0.5, small)["max_pae"] == 31.75
    plot_pae(tmp_path / "small.png", small, "t")
    plot_pae(tmp_path / "large.png", large, "t")
    a, b = mpimg.imread(tmp_path / "small.png"), mpimg.imread(tmp_path / "large.png")
    assert a.shape == b.shape
    centre = (a.shape[0] // 2, int(a.shape[1] * 0.4))  # inside the heat map, away from the [0, 0] cell
    np.testing.assert_allclose(a[centre], b[centre], atol=2 / 255)

    def red_pixels(path):
        img = mpimg.imread(path)[..., :3]
        return int(((img[..., 0] > 0.8) & (img[..., 1] < 0.6) & (img[..., 2] < 0.6)).sum())

    plot_pae(tmp_path / "marked.png", small, "t", mark="RANDOM WEIGHTS")
    plot_plddt(tmp_path / "plddt.png", np.linspace(20, 95, 12), "t")
    plot_plddt(tmp_path / "plddt_marked.png", np.linspace(20, 95, 12), "t", mark="RANDOM WEIGHTS")
    assert red_pixels(tmp_path / "small.png") == 0 and red_pixels(tmp_path / "marked.png") > 500
    assert red_pixels(tmp_path / "plddt.png") == 0 and red_pixels(tmp_path / "plddt_marked.png") > 500


def _modelcif_warnings(text: str) -> tuple[list, set[str]]:
    """The systems python-modelcif reads from `text`, and what its reader does not know there (unknown
    categories and keywords)."""
    import io
    import warnings

    import modelcif.reader

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        systems = modelcif.reader.read(io.StringIO(text), warn_unknown_category=True, warn_unknown_keyword=True)
    return systems, {str(w.message).split(" encountered")[0] for w in caught}


def _modelcif_reference() -> str:
    """A one-model file written by python-modelcif itself: what it writes but does not read back is fine."""
    import io

    import modelcif
    import modelcif.dumper
    import modelcif.model
    import modelcif.protocol
    import modelcif.qa_metric

    entity = modelcif.Entity("MG", description="target")
    asym = modelcif.AsymUnit(entity, details="chain A", id="A")

    class Local(modelcif.qa_metric.Local, modelcif.qa_metric.PLDDT):
        """Predicted accuracy according to the CA-only lDDT in [0,100]"""

        name, software = "pLDDT", None

    class Global(modelcif.qa_metric.Global, modelcif.qa_metric.PLDDT):
        """Predicted accuracy according to the CA-only lDDT in [0,100]"""

        name, software = "pLDDT", None

    class Model(modelcif.model.AbInitioModel):
        def get_atoms(self):
            for i in (1, 2):
                yield modelcif.model.Atom(asym_unit=asym, seq_id=i, atom_id="CA", type_symbol="C", x=3.8 * i, y=0.0,
                                          z=0.0, het=False, biso=50.0, occupancy=1.0)

    model = Model(assembly=modelcif.Assembly((asym,)), name="Model")
    model.qa_metrics += [Global(50.0), Local(asym.residue(1), 50.0), Local(asym.residue(2), 50.0)]
    system = modelcif.System(title="reference", id="REF")
    software = modelcif.Software(name="x", classification="model building", description="x", location="x",
                                 type="program", version="1")
    system.software.append(software)
    system.model_groups.append(modelcif.model.ModelGroup([model], name="All models"))
    protocol = modelcif.protocol.Protocol()
    protocol.steps.append(modelcif.protocol.ModelingStep(input_data=None, output_data=model, name="prediction",
                                                         software=modelcif.SoftwareGroup([software])))
    system.protocols.append(protocol)
    out = io.StringIO()
    modelcif.dumper.write(out, [system])
    return out.getvalue()


def test_mmcif_is_modelcif_read_back_by_python_modelcif(protein):
    """Issue 21: valid ModelCIF. python-modelcif reads the file back into one model with its atoms, the entity's
    sequence, the software and protocol, and pLDDT per residue (every parent of `_ma_qa_metric_local`) and its
    mean; the file holds nothing python-modelcif would not write itself."""
    pytest.importorskip("modelcif")
    plddt = np.linspace(20.0, 95.0, len(SEQUENCE))
    text = to_mmcif(protein, name="x_model_1", plddt=plddt, title="RANDOM WEIGHTS: it's meaningless")
    (system,), unknown = _modelcif_warnings(text)
    _, unknown_to_itself = _modelcif_warnings(_modelcif_reference())
    assert unknown <= unknown_to_itself, f"categories/keywords python-modelcif neither reads nor writes: " \
                                         f"{sorted(unknown - unknown_to_itself)}"
    assert system.id == "x_model_1" and "RANDOM WEIGHTS: it's meaningless" in system.title
    (entity,) = system.entities
    assert "".join(c.code_canonical for c in entity.sequence) == SEQUENCE
    assert [s.name for s in system.software] == ["lowmem-suite fold"]
    (step,) = system.protocols[0].steps
    assert step.method_type == "modeling" and [s.name for s in step.software] == ["lowmem-suite fold"]
    (group,) = system.model_groups
    (model,) = list(group)
    atoms = model._atoms
    assert len(atoms) == int(protein.atom_mask.sum())
    first = atoms[0]
    assert (first.seq_id, first.atom_id) == (1, "N")
    np.testing.assert_allclose([first.x, first.y, first.z], protein.atom_positions[0, 0], atol=1e-3)
    local = [q for q in model.qa_metrics if hasattr(q, "residue")]
    glob = [q for q in model.qa_metrics if not hasattr(q, "residue")]
    assert [q.residue.seq_id for q in local] == list(range(1, len(SEQUENCE) + 1))
    assert all(q.residue.asym.id == "A" for q in local)
    np.testing.assert_allclose([q.value for q in local], plddt, atol=0.005)
    assert len(glob) == 1 and glob[0].value == pytest.approx(plddt.mean(), abs=0.005)
    assert {type(q).__name__ for q in model.qa_metrics} == {"pLDDT"}


def test_modelcif_plddt_is_plddt_when_the_b_factors_are_not(protein):
    """With --subtract_plddt the B-factors hold 100 - pLDDT; the QA metrics still hold pLDDT."""
    plddt = np.linspace(20.0, 95.0, len(SEQUENCE))
    flipped = Protein(protein.atom_positions, protein.atom_mask, protein.aatype, protein.residue_index,
                      100.0 - protein.b_factors)
    text = to_mmcif(flipped, name="x", plddt=plddt)
    rows = text.split("_ma_qa_metric_local.metric_value\n", 1)[1].split("\n#", 1)[0].splitlines()
    np.testing.assert_allclose([float(r.split()[-1]) for r in rows], plddt, atol=0.005)


def test_msa_coverage_as_colabfold_counts_it(tmp_path):
    """Per-position coverage (non-gap rows), each row's identity to the query over the query's length, rows
    from most to least identical, gaps empty (NaN); the plot is a PNG with the identity colours and the line."""
    import matplotlib.image as mpimg

    g = 21
    msa = np.array([
        [0, 1, 2, 3, 4, 5, 6, 7],  # the query
        [9, 9, 2, 3, 9, 9, g, g],  # 2 of 8 identical
        [g, 1, 2, 3, 4, 5, 6, g],  # 6 of 8 identical
        [g, g, g, g, g, g, g, 7],  # 1 of 8
    ])
    image, coverage, identity = msa_coverage(msa)
    np.testing.assert_array_equal(coverage, [2, 3, 3, 3, 3, 3, 2, 2])
    np.testing.assert_allclose(identity, [1.0, 6 / 8, 2 / 8, 1 / 8])
    np.testing.assert_array_equal(np.isnan(image), (msa == g)[[0, 2, 1, 3]])
    np.testing.assert_allclose(image[1, 1:7], 6 / 8)
    np.testing.assert_allclose(image[3, 7], 1 / 8)
    path = tmp_path / "cov.png"
    plot_msa_coverage(path, msa, "t: sequence coverage (4 sequences)")
    img = mpimg.imread(path)[..., :3]
    colourful = (img.max(-1) - img.min(-1)) > 0.3
    black = img.max(-1) < 0.15
    assert colourful.sum() > 2000 and black.sum() > 100
